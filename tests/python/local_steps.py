"""powersgd.torch.LocalSteps (local steps with a compressed outer step, no DDP), every rank of a powersgd-run
job runs one case:

    powersgd-run -n 3 -- python3 tests/python/local_steps.py CASE

Cases:
  replicas    ranks start from different models and train on different data (SGD with momentum, H = 3, PowerSGD
              rank 1 with error feedback, two buckets): after construction and after every outer step the
              parameters are bitwise identical on every rank (and differ between outer steps)
  reference   uncompressed (compression=False), DiLoCo's outer lr 0.7 and Nesterov momentum 0.9, 2 ranks: each
              outer step equals, bit for bit, the update computed here from every rank's parameters
  checkpoint  state_dict() with the model's and optimizer's between outer steps, torch.save, a fresh model,
              optimizer and LocalSteps, load: the resumed run ends bitwise on the uninterrupted run's
              parameters; loading another rank's state_dict (rank 0's on every rank) fails on every rank and
              changes nothing, as do a malformed state_dict and another outer_lr; a full temporary directory
              on rank 1 (mkdtemp fails) fails both ranks within seconds (PSGD_TIMEOUT_MS 10 s), nothing changed
  errors      bad local_steps, outer_lr, outer_momentum, bucket_cap_mb and PowerSGD arguments: TypeError or
              ValueError naming the argument and its value, before any collective (also the values only the
              engine's float32 checks refused, after its collectives); ranks constructed with another outer_lr
              fail together; NaN in one rank's parameters fails the outer step on every rank with the
              parameters, start point, outer momentum, error memory and outer_steps as they were, and the outer
              step then succeeds once the NaN is gone
  outer-end   outer_step() after a loop whose last step() took the outer step is a no-op (parameters, error
              memory, outer_steps and the reducer's steps unchanged; it applied the error memory and momentum
              again), also after load_state_dict(); after an inner step it runs; zero_grad() of an optimizer
              whose zero_grad takes no argument
  reinit      destroy_process_group() and init_process_group() again (1 rank each through its own FileStore,
              then both through a shared one): each new LocalSteps gets a communicator of the new group (it
              reused the first group's), and the stale one is destroyed
Exit 77 (skip) when torch is not importable.
"""
import ctypes
import gc
import hashlib
import io
import math
import os
import shutil
import sys
import tempfile
import time
import weakref

try:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:
    print("torch is not installed (Debian: python3-torch): skipped")
    sys.exit(77)

import powersgd.torch as pst
from powersgd import _capi


def rank():
    return dist.get_rank()


def fail(message):
    raise AssertionError("rank %d: %s" % (rank(), message))


def model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 5))


def data(seed, steps, batch=16):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 20, generator=g), torch.randint(0, 5, (batch,), generator=g)) for _ in range(steps)]


def inner(net, optimizer, x, y):
    optimizer.zero_grad()
    F.cross_entropy(net(x), y).backward()


def digest(net):
    h = hashlib.sha256()
    for p in net.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def digests(net):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, digest(net))
    return everyone


def snapshot(net):
    return [p.detach().clone() for p in net.parameters()]


def same_bits(a, b):
    return all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b))


def case_replicas():
    net = model(seed=rank())  # different on every rank: construction takes rank 0's
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    # bucket_cap_mb small enough for two buckets (the first holds up to 1 MiB)
    outer = pst.LocalSteps(net, optimizer, local_steps=3, matrix_approximation_rank=1, bucket_cap_mb=0.001)
    if len(outer._buckets) < 2:
        fail("expected several buckets, got %s" % outer._buckets)
    if len(set(digests(net))) != 1:
        fail("parameters differ after construction: %s" % digests(net))
    outers = 0
    for step, (x, y) in enumerate(data(100 + rank(), 12)):
        inner(net, optimizer, x, y)
        outer.step()
        hashes = digests(net)
        if (step + 1) % 3 == 0:
            outers += 1
            if len(set(hashes)) != 1 or outer.outer_steps != outers:
                fail("after outer step %d (inner step %d): parameters %s, outer_steps %d"
                     % (outers, step + 1, hashes, outer.outer_steps))
        elif len(set(hashes)) == 1:
            fail("inner step %d: the ranks' parameters are equal between outer steps" % (step + 1))
    if outer.bytes_sent() <= 0:
        fail("bytes_sent() = %d" % outer.bytes_sent())
    if rank() == 0:
        print("replicas: bitwise identical after construction and %d outer steps (%d buckets, %d bytes)"
              % (outers, len(outer._buckets), outer.bytes_sent()))


def case_reference():
    lr, mu = 0.7, 0.9
    net = model(seed=rank())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    outer = pst.LocalSteps(net, optimizer, local_steps=2, outer_lr=lr, outer_momentum=mu, compression=False)
    start = snapshot(net)
    momentum = [torch.zeros_like(p) for p in start]
    lr32, mu32 = torch.tensor(lr, dtype=torch.float32), torch.tensor(mu, dtype=torch.float32)
    world = dist.get_world_size()
    for step, (x, y) in enumerate(data(200 + rank(), 8)):
        inner(net, optimizer, x, y)
        optimizer.step()  # the inner step by hand, then the outer step by hand: the reference needs the state between
        outer.inner_steps += 1
        if outer.due() != ((step + 1) % 2 == 0):
            fail("due() = %s after %d inner steps" % (outer.due(), step + 1))
        if outer.due():  # the reference from every rank's parameters
            mine = snapshot(net)
            expected = []
            for i, p in enumerate(mine):
                gathered = [torch.empty_like(p) for _ in range(world)]
                dist.all_gather(gathered, p)
                pseudo = [start[i] - x_r for x_r in gathered]
                mean = (pseudo[0] + pseudo[1]) * torch.tensor(0.5, dtype=torch.float32)
                momentum[i] = mu32 * momentum[i] + mean
                start[i] = start[i] - lr32 * (mean + mu32 * momentum[i])
                expected.append(start[i])
        if outer.due():
            outer.outer_step()
            got = snapshot(net)
            if not same_bits(got, expected):
                worst = max(float((g - e).abs().max()) for g, e in zip(got, expected))
                fail("outer step %d: parameters differ from the reference (max abs difference %g)"
                     % ((step + 1) // 2, worst))
    if rank() == 0:
        print("reference: 4 uncompressed outer steps (lr 0.7, Nesterov 0.9) bit for bit")


def checkpoint_run(first, last, resume=None, save_at=None):
    """Inner steps first..last-1 of one run (H = 3, rank 1, error feedback); returns (net, saved bytes)."""
    net = model(seed=7)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    outer = pst.LocalSteps(net, optimizer, local_steps=3, matrix_approximation_rank=1, bucket_cap_mb=0.001)
    if resume is not None:
        state = torch.load(io.BytesIO(resume))
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        outer.load_state_dict(state["outer"])
    saved = None
    batches = data(300 + rank(), last)
    for step in range(first, last):
        if step == save_at:
            buffer = io.BytesIO()
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                        "outer": outer.state_dict()}, buffer)
            saved = buffer.getvalue()
        inner(net, optimizer, *batches[step])
        outer.step()
    return net, outer, saved


def error_memory(outer):
    out = []
    for b, flat in enumerate(outer._flat):
        memory = torch.zeros(flat.numel(), dtype=torch.float32)
        _capi.check(_capi.lib.psgd_reducer_error_feedback_n(outer._reducer, b, ctypes.c_void_p(memory.data_ptr()),
                                                            memory.numel()))
        out.append(memory)
    return out


def expect(what, fn, kind, words):
    try:
        fn()
    except kind as e:
        missing = [w for w in words if w not in str(e)]
        if missing:
            fail("%s: the message %r lacks %s" % (what, str(e), missing))
        return str(e)
    fail("%s: expected %s" % (what, kind.__name__))


def case_checkpoint():
    os.environ["PSGD_TIMEOUT_MS"] = "10000"  # the engine communicator's (created below): a rank left waiting fails
    whole, outer, _ = checkpoint_run(0, 14)  # ends between outer steps (4 outer steps)
    if outer.outer_steps != 4:
        fail("outer_steps %d" % outer.outer_steps)
    _, _, saved = checkpoint_run(0, 8, save_at=7)  # saved after 7 inner steps: between outer steps 2 and 3
    resumed, outer, _ = checkpoint_run(7, 14, resume=saved)
    if digest(resumed) != digest(whole) or outer.outer_steps != 4 or outer.inner_steps != 14:
        fail("resumed run: parameters %s, uninterrupted %s; outer_steps %d, inner_steps %d"
             % (digest(resumed), digest(whole), outer.outer_steps, outer.inner_steps))

    # rank 0's state_dict on every rank: refused on rank 1, so on every rank, nothing changed
    everyone = [None, None]
    dist.all_gather_object(everyone, saved)
    state = torch.load(io.BytesIO(everyone[0]))
    net = model(seed=7)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    outer = pst.LocalSteps(net, optimizer, local_steps=3, matrix_approximation_rank=1, bucket_cap_mb=0.001)
    before = outer.state_dict()
    expect("rank 0's state_dict on rank %d" % rank(), lambda: outer.load_state_dict(state["outer"]),
           pst.PowerSGDError, ["nothing loaded", "each rank loads its own" if rank() == 1 else "rank(s) [1]"])
    after = outer.state_dict()
    if (before["outer"], before["reducer"], before["inner_steps"]) != (after["outer"], after["reducer"],
                                                                       after["inner_steps"]):
        fail("a refused load_state_dict changed the state")
    expect("a malformed state_dict", lambda: outer.load_state_dict({"version": 1}), pst.PowerSGDError,
           ["not a LocalSteps.state_dict()", "nothing loaded"])
    state["outer"]["config"] = dict(state["outer"]["config"], outer_lr=0.5)
    expect("another outer_lr", lambda: outer.load_state_dict(state["outer"]), pst.PowerSGDError,
           ["outer_lr = 0.5", "nothing loaded"])
    # Fields read after the reducer was loaded (the outer state, inner_steps) are checked before it, on one rank
    # only too: refused on every rank, nothing changed (a missing "outer" raised KeyError with the reducer loaded
    # and the other ranks waiting; an inner_steps of "x" a ValueError with both loaded).
    own = outer.state_dict()
    for what, edit, words in [("no outer state", lambda d: d.pop("outer"), "'outer'"),
                              ("an inner_steps of 'x'", lambda d: d.update(inner_steps="x"), "inner_steps = 'x'"),
                              ("a negative inner_steps", lambda d: d.update(inner_steps=-2), "inner_steps = -2")]:
        bad = dict(own)
        if rank() == 1:
            edit(bad)
        expect(what, lambda: outer.load_state_dict(bad), pst.PowerSGDError,
               ["nothing loaded", words if rank() == 1 else "rank(s) [1]"])
        after = outer.state_dict()
        if (own["outer"], own["reducer"], own["inner_steps"]) != (after["outer"], after["reducer"],
                                                                  after["inner_steps"]):
            fail("a refused load_state_dict (%s) changed the state" % what)
    # A local failure before the agreement on one rank only (a full temporary directory: mkdtemp raises): every
    # rank refuses at once, nothing changed, and the ranks go on (rank 1 raised OSError before the agreement,
    # rank 0 waited in it for the whole timeout, and the communicator was broken).
    real = tempfile.mkdtemp

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    if rank() == 1:
        tempfile.mkdtemp = full
    start = time.monotonic()
    try:
        expect("a full temporary directory on rank 1", lambda: outer.load_state_dict(own), pst.PowerSGDError,
               ["nothing loaded", "No space left on device" if rank() == 1 else "rank(s) [1]"])
    finally:
        tempfile.mkdtemp = real
    waited = time.monotonic() - start
    if waited > 5:
        fail("the refused load took %.1f s (PSGD_TIMEOUT_MS 10 s): a rank waited for the other" % waited)
    after = outer.state_dict()
    if (own["outer"], own["reducer"], own["inner_steps"]) != (after["outer"], after["reducer"], after["inner_steps"]):
        fail("a load refused for a full temporary directory changed the state")
    outer.load_state_dict(own)  # and the ranks go on together
    if rank() == 0:
        print("checkpoint: resumed between outer steps bitwise; another rank's and another config refused; a full "
              "temporary directory on rank 1 refused on both in %.2f s" % waited)


def case_errors():
    net = model(seed=0)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    bad = [({"local_steps": 0}, ValueError, ["local_steps = 0", ">= 1"]),
           ({"local_steps": -3}, ValueError, ["local_steps = -3"]),
           ({"local_steps": 1.5}, TypeError, ["local_steps = 1.5", "integer"]),
           ({"local_steps": True}, TypeError, ["local_steps = True"]),
           ({"outer_lr": 0}, ValueError, ["outer_lr = 0", "> 0"]),
           ({"outer_lr": -0.1}, ValueError, ["outer_lr = -0.1"]),
           ({"outer_lr": math.nan}, ValueError, ["outer_lr = nan"]),
           ({"outer_lr": math.inf}, ValueError, ["outer_lr = inf"]),
           ({"outer_lr": "1"}, TypeError, ["outer_lr = '1'", "a number"]),
           ({"outer_momentum": 1.0}, ValueError, ["outer_momentum = 1.0", "0 <= outer_momentum < 1"]),
           ({"outer_momentum": -0.5}, ValueError, ["outer_momentum = -0.5"]),
           ({"outer_momentum": math.nan}, ValueError, ["outer_momentum = nan"]),
           ({"bucket_cap_mb": 0}, ValueError, ["bucket_cap_mb = 0"]),
           # Refused by the engine's float32 checks only after its collectives (PowerSGDError), or by Python
           # (OverflowError), or cut by ctypes: now each by name before any collective.
           ({"outer_lr": 1e39}, ValueError, ["outer_lr = 1e+39", "float holds"]),
           ({"outer_lr": 1e-50}, ValueError, ["outer_lr = 1e-50", "float holds"]),
           ({"outer_lr": 1e-39}, ValueError, ["outer_lr = 1e-39"]),  # a subnormal float
           ({"outer_momentum": 0.99999999999}, ValueError, ["outer_momentum = 0.99999999999", "as a float"]),
           ({"local_steps": 2**63}, ValueError, ["local_steps = %d" % 2**63]),
           ({"local_steps": 2**64 + 4}, ValueError, ["local_steps = %d" % (2**64 + 4)]),
           ({"bucket_cap_mb": math.inf}, ValueError, ["bucket_cap_mb = inf"]),
           ({"bucket_cap_mb": math.nan}, ValueError, ["bucket_cap_mb = nan"]),
           ({"matrix_approximation_rank": 0}, ValueError, ["matrix_approximation_rank"]),
           ({"matrix_approximation_rank": 2.5}, TypeError, ["matrix_approximation_rank = 2.5"]),
           ({"use_error_feedback": 2}, ValueError, ["use_error_feedback = 2"]),
           ({"compression": "no"}, ValueError, ["compression = 'no'"])]
    for options, kind, words in bad:
        args = dict({"local_steps": 4}, **options)
        expect("LocalSteps(%s)" % options, lambda: pst.LocalSteps(net, optimizer, **args), kind,
               ["LocalSteps: "] + words)
    expect("no optimizer", lambda: pst.LocalSteps(net, None), TypeError, ["optimizer = None"])
    # The engine's bounds themselves are accepted (float's smallest normal rate, the momentum below 1.0f).
    edge = pst.LocalSteps(net, optimizer, outer_lr=2.0**-126, outer_momentum=1 - 2.0**-24,
                          local_steps=2**63 - 1)
    edge.close()
    expect("no parameters", lambda: pst.LocalSteps(nn.ReLU(), optimizer), ValueError, ["there are none"])
    # Ranks with other settings fail together in the collective construction.
    message = expect("outer_lr differing", lambda: pst.LocalSteps(net, optimizer, outer_lr=1.0 if rank() else 0.5),
                     pst.PowerSGDError, ["PSGD_ERR_MISMATCH"])
    if "outer." in message:
        fail("the mismatch names the engine's fields: %s" % message)

    # NaN on one rank: every rank fails, nothing changes; without it the step succeeds.
    net = model(seed=rank())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    outer = pst.LocalSteps(net, optimizer, local_steps=2, matrix_approximation_rank=1, outer_lr=0.7,
                           outer_momentum=0.9, bucket_cap_mb=0.001)
    batches = data(400 + rank(), 6)
    for x, y in batches[:4]:
        inner(net, optimizer, x, y)
        outer.step()
    for x, y in batches[4:]:
        inner(net, optimizer, x, y)
        optimizer.step()
        outer.inner_steps += 1  # counted by hand, as step() would (outer_step() is a no-op without inner steps)
    params = snapshot(net)
    memory, state = error_memory(outer), outer.state_dict()
    if not any(float(m.abs().max()) > 0 for m in memory):
        fail("expected nonzero error memory after two compressed outer steps")
    if rank() == 1:
        with torch.no_grad():
            next(net.parameters())[0, 0] = math.nan
    expect("NaN on rank 1", outer.outer_step, pst.PowerSGDError, ["PSGD_ERR_NONFINITE"])
    if rank() == 1:
        with torch.no_grad():
            next(net.parameters())[0, 0] = params[0][0, 0]
    after = outer.state_dict()
    if not same_bits(snapshot(net), params) or outer.outer_steps != 2 or after["outer"] != state["outer"]:
        fail("the failed outer step changed the parameters, start point, momentum or outer_steps (%d)"
             % outer.outer_steps)
    if not same_bits(error_memory(outer), memory):
        fail("the failed outer step changed the error memory")
    outer.outer_step()
    if outer.outer_steps != 3 or len(set(digests(net))) != 1:
        fail("the outer step after the failure: outer_steps %d, parameters %s" % (outer.outer_steps, digests(net)))
    if rank() == 0:
        print("errors: %d bad arguments refused by name; NaN on rank 1 failed every rank and changed nothing"
              % (len(bad) + 2))


class PlainOptimizer:
    """An inner optimizer of the caller's own: step() and a zero_grad() that takes no argument."""

    def __init__(self, params, lr):
        self.params, self.lr = list(params), lr

    def step(self):
        with torch.no_grad():
            for p in self.params:
                p -= self.lr * p.grad

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def reducer_steps(outer):
    return int(_capi.lib.psgd_reducer_iteration(outer._reducer))


def case_outer_end():
    net = model(seed=rank())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    # Compressed with error feedback and outer momentum: a second outer step would apply both again.
    outer = pst.LocalSteps(net, optimizer, local_steps=2, matrix_approximation_rank=1, outer_lr=0.7,
                           outer_momentum=0.9, bucket_cap_mb=0.001)
    ran = outer.outer_step()
    if outer.outer_steps != 0 or ran is not False:
        fail("outer_step() right after construction ran an outer step (outer_steps %d)" % outer.outer_steps)
    for x, y in data(500 + rank(), 4):
        outer.zero_grad()
        F.cross_entropy(net(x), y).backward()
        outer.step()  # the 4th takes outer step 2
    if outer.outer_steps != 2 or not any(float(m.abs().max()) > 0 for m in error_memory(outer)):
        fail("expected 2 outer steps and nonzero error memory, got %d" % outer.outer_steps)
    params, memory, steps = snapshot(net), error_memory(outer), reducer_steps(outer)
    saved = outer.state_dict()
    ran = outer.outer_step()  # the loop ended on an outer step: "end on the synchronised model"
    if not same_bits(snapshot(net), params) or outer.outer_steps != 2 or reducer_steps(outer) != steps \
            or not same_bits(error_memory(outer), memory) or outer.state_dict()["outer"] != saved["outer"]:
        fail("outer_step() with no inner step since the last outer step changed the state: outer_steps %d, "
             "reducer steps %d (were %d), parameters %s" % (outer.outer_steps, reducer_steps(outer), steps,
                                                            "unchanged" if same_bits(snapshot(net), params)
                                                            else "changed"))
    if ran is not False:
        fail("outer_step() after the loop's last step() took one returned %r" % (ran,))
    # Loaded: the same (the dict says where the last outer step was).
    outer.load_state_dict(saved)
    ran = outer.outer_step()
    if outer.outer_steps != 2 or not same_bits(snapshot(net), params) or ran is not False:
        fail("outer_step() after load_state_dict of a dict saved on an outer step ran one")
    # After an inner step it runs, and ends on the synchronised model.
    x, y = data(600 + rank(), 1)[0]
    outer.zero_grad()
    F.cross_entropy(net(x), y).backward()
    outer.step()
    ran = outer.outer_step()
    if outer.outer_steps != 3 or len(set(digests(net))) != 1 or ran is not True:
        fail("outer_step() after an inner step: outer_steps %d, parameters %s" % (outer.outer_steps, digests(net)))
    ran = outer.outer_step()
    if outer.outer_steps != 3 or ran is not False:
        fail("a second outer_step() ran (outer_steps %d)" % outer.outer_steps)
    # zero_grad(): the optimizer's own, with set_to_none only where given.
    outer.zero_grad(set_to_none=True)
    if any(p.grad is not None for p in net.parameters()):
        fail("zero_grad(set_to_none=True) left gradients")
    plain_net = model(seed=rank())
    plain = PlainOptimizer(plain_net.parameters(), lr=0.05)
    plain_outer = pst.LocalSteps(plain_net, plain, local_steps=2)
    for x, y in data(700 + rank(), 2):
        plain_outer.zero_grad()  # TypeError: zero_grad() got an unexpected keyword argument 'set_to_none'
        F.cross_entropy(plain_net(x), y).backward()
        plain_outer.step()
    if plain_outer.outer_steps != 1 or len(set(digests(plain_net))) != 1:
        fail("the optimizer of the caller's own: outer_steps %d" % plain_outer.outer_steps)
    if rank() == 0:
        print("outer-end: outer_step() after an outer step changed nothing (outer_steps 2, reducer steps %d); "
              "after an inner step it ran; zero_grad() of an optimizer's own zero_grad(self)" % steps)


def case_reinit():
    me = rank()
    directory = [tempfile.mkdtemp(prefix="powersgd-reinit-") if me == 0 else None]
    dist.broadcast_object_list(directory)
    directory = directory[0]
    lib = _capi.lib

    def placed(outer):
        return lib.psgd_comm_rank(outer._comm), lib.psgd_comm_size(outer._comm)

    def train(outer, net, optimizer, seed):
        for x, y in data(seed, 2):
            inner(net, optimizer, x, y)
            outer.step()

    net = model(seed=me)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    outer = pst.LocalSteps(net, optimizer, local_steps=2, compression=False)
    if placed(outer) != (me, 2):
        fail("the job's communicator is rank %d of %d" % placed(outer))
    train(outer, net, optimizer, 800 + me)
    stale = weakref.ref(outer._comm)
    del outer
    dist.destroy_process_group()

    # Each rank alone: a group of one, through its own FileStore.
    dist.init_process_group("gloo", init_method="file://%s/alone-%d" % (directory, me), rank=0, world_size=1)
    net = model(seed=10 + me)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    alone = pst.LocalSteps(net, optimizer, local_steps=2, compression=False)
    if placed(alone) != (0, 1):
        fail("after init_process_group of 1 rank, a new LocalSteps serves rank %d of %d (the old group's "
             "communicator)" % placed(alone))
    gc.collect()
    if stale() is not None:
        fail("the first group's communicator was not destroyed once no LocalSteps used it")
    train(alone, net, optimizer, 900 + me)
    if alone.outer_steps != 1:
        fail("alone: outer_steps %d" % alone.outer_steps)
    del alone
    dist.destroy_process_group()

    # Both ranks again, through a shared FileStore: a communicator of 2 ranks on the new store.
    dist.init_process_group("gloo", init_method="file://%s/pair" % directory, rank=me, world_size=2)
    net = model(seed=20 + me)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    pair = pst.LocalSteps(net, optimizer, local_steps=2, compression=False)
    if placed(pair) != (me, 2) or len(set(digests(net))) != 1:
        fail("the pair: rank %d of %d, parameters %s" % (placed(pair) + (digests(net),)))
    train(pair, net, optimizer, 1000 + me)
    if pair.outer_steps != 1 or len(set(digests(net))) != 1:
        fail("the pair: outer_steps %d, parameters %s" % (pair.outer_steps, digests(net)))
    dist.barrier()
    if me == 0:
        shutil.rmtree(directory, ignore_errors=True)
        print("reinit: a communicator per process group (2 ranks, then 1 each, then 2 on a new store); the stale "
              "one destroyed")


CASES = {"replicas": case_replicas, "reference": case_reference, "checkpoint": case_checkpoint,
         "errors": case_errors, "outer-end": case_outer_end, "reinit": case_reinit}


def main():
    if len(sys.argv) != 2 or sys.argv[1] not in CASES:
        print("usage: local_steps.py {%s}" % ",".join(CASES), file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    pst.init_process_group("gloo")
    CASES[sys.argv[1]]()
    dist.barrier()
    if rank() == 0:
        print("%s: passed" % sys.argv[1])
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
