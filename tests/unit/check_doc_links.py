#!/usr/bin/env python3
"""Every relative link of README.md and docs/*.md names a file of the source tree, and its #anchor, when it
has one, a heading of that file (GitHub's anchors: lower case, punctuation dropped, spaces to hyphens).
    check_doc_links.py SOURCE_DIR
Prints each broken link with its file and line; exit 1 when there is one."""
import glob
import os
import re
import sys

LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")


def anchors(path):
    """The anchors GitHub gives the headings of a Markdown file."""
    found, seen, fenced = set(), {}, False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if FENCE.match(line):
                fenced = not fenced
            if fenced or not line.startswith("#"):
                continue
            text = line.lstrip("#").strip().lower()
            slug = re.sub(r"[^\w\- ]", "", text.replace("`", "")).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(source_dir, doc):
    base = os.path.dirname(doc)
    fenced = False
    with open(doc, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if FENCE.match(line):
                fenced = not fenced
            if fenced:
                continue
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue  # http(s), mailto: not checked (offline)
                path, _, anchor = target.partition("#")
                resolved = os.path.normpath(os.path.join(base, path)) if path else doc
                where = f"{os.path.relpath(doc, source_dir)}:{number}: ({target})"
                if not os.path.exists(resolved):
                    yield f"{where}: no file {os.path.relpath(resolved, source_dir)}"
                elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
                    yield f"{where}: no heading with the anchor #{anchor} in {os.path.relpath(resolved, source_dir)}"


def main():
    source_dir = os.path.abspath(sys.argv[1])
    docs = [os.path.join(source_dir, "README.md")] + sorted(glob.glob(os.path.join(source_dir, "docs", "*.md")))
    broken = [problem for doc in docs for problem in broken_links(source_dir, doc)]
    for problem in broken:
        print(problem)
    print(f"check_doc_links: {len(docs)} files, {len(broken)} broken links")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
