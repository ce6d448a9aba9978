"""powersgd.torch under real DDP (Gloo, CPU), every rank of a powersgd-run job runs one case:

    powersgd-run -n 2 -- python3 tests/python/ddp_hook.py CASE

Cases (PyTorch's own parity check for comm hooks, ported to CPU):
  parity-plain      start_powerSGD_iter beyond the run: parameters equal DDP allreduce's to 1e-5
  parity-exact      the mean gradient has rank <= r (batch of 1 per rank, 2 ranks, r = 2), compressed from
                    iteration 3 with error feedback: parameters equal DDP allreduce's to 1e-5; the same with
                    gradient_as_bucket_view, static_graph, find_unused_parameters (an unused layer)
  low-rank          rank 1 with error feedback on a regression task: the loss curve follows allreduce's
  many-buckets      a model in 12+ DDP buckets trains (loss falls), compressed, parameters equal on all ranks
  groups            two disjoint process groups (ranks of equal parity: {0, 2} and {1, 3}, or {0} and {1}), DDP
                    on each with our hook and with PyTorch's powerSGD_hook at an exact rank: the same parameters
                    (and not those of an average over every rank); a group this rank is not in is refused
  errors            NaN gradients and a bucket layout changing after the declaration fail from the future /
                    backward() with PowerSGDError naming the failure, on every rank, without hanging
Exit 77 (skip) when torch is not importable.
"""
import copy
import ctypes
import sys

try:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
except ImportError:
    print("torch is not installed (Debian: python3-torch): skipped")
    sys.exit(77)

import powersgd.torch as pst

STEPS = 12
LOW_RANK_LR = 0.5


def rank():
    return dist.get_rank()


def world():
    return dist.get_world_size()


def ddp(model, **options):
    return nn.parallel.DistributedDataParallel(model, **options)


def check_close(name, got, expected, tolerance, reference="DDP allreduce's"):
    """The largest parameter difference; AssertionError past the tolerance."""
    worst = 0.0
    for (pname, a), b in zip(got.named_parameters(), expected.parameters()):
        difference = (a.detach() - b.detach()).abs().max().item()
        if not difference <= tolerance:
            raise AssertionError("%s: parameter %s differs from %s by %g (tolerance %g)"
                                 % (name, pname, reference, difference, tolerance))
        worst = max(worst, difference)
    return worst


def train(model, inputs, targets, lr=0.05):
    """SGD steps; returns the loss of each step (this rank's batch)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in zip(inputs, targets):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


class TwoLayers(nn.Module):
    """Two linear layers, and with `unused` one never used in forward (find_unused_parameters)."""

    def __init__(self, unused=False):
        super().__init__()
        self.first = nn.Linear(16, 32, bias=False)
        self.second = nn.Linear(32, 8)
        if unused:
            self.unused = nn.Linear(8, 8)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def data(batch, steps, seed):
    generator = torch.Generator().manual_seed(seed * 1000 + rank())
    return ([torch.randn(batch, 16, generator=generator) for _ in range(steps)],
            [torch.randn(batch, 8, generator=generator) for _ in range(steps)])


def parity(name, state_options, model_factory, ddp_options, batch, tolerance, steps=STEPS):
    torch.manual_seed(1)
    reference = model_factory()
    ours = copy.deepcopy(reference)
    inputs, targets = data(batch, steps, seed=2)
    train(ddp(reference, **ddp_options), inputs, targets)
    model = ddp(ours, **ddp_options)
    state = pst.PowerSGDState(process_group=None, **state_options)
    model.register_comm_hook(state, pst.powerSGD_hook)
    train(model, inputs, targets)
    return state, check_close(name, ours, reference, tolerance)


def case_parity_plain():
    state, _ = parity("parity-plain", dict(matrix_approximation_rank=1, start_powerSGD_iter=10_000),
                      lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)), {}, batch=4,
                      tolerance=1e-5)
    assert state.compression_stats()[1] == 0, "compressed before start_powerSGD_iter"
    assert state.iter == STEPS


def case_parity_exact():
    # One sample per rank: every weight gradient has rank 1 per rank, so the mean over 2 ranks has rank <= 2
    # and PowerSGD at rank 2 reproduces it up to float rounding.
    variants = {
        "default": {},
        "gradient_as_bucket_view": dict(gradient_as_bucket_view=True),
        "static_graph": dict(static_graph=True),
        "find_unused_parameters": dict(find_unused_parameters=True),
    }
    # Without error feedback the output is the mean up to rounding, over the whole run. With error feedback
    # PowerSGD is exact only while the ranks' error memories cancel in their mean; rounding leaves a tiny
    # mean error outside the rank-r span, and the algorithm amplifies it geometrically (about 2.5x per step
    # here; the reference algorithm in float64 numpy does the same from 1e-15, see docs/torch.md). So with
    # error feedback the check covers the first 4 compressed steps, where the drift is still below 1e-5.
    for error_feedback, warm_start, steps in [(False, True, STEPS), (False, False, STEPS), (True, True, 7),
                                              (True, False, 7)]:
        options = dict(matrix_approximation_rank=2, start_powerSGD_iter=2, use_error_feedback=error_feedback,
                       warm_start=warm_start)
        for variant, ddp_options in variants.items():
            name = "parity-exact/%s/error_feedback=%s/warm_start=%s" % (variant, error_feedback, warm_start)
            factory = (lambda: TwoLayers(unused=True)) if variant == "find_unused_parameters" else TwoLayers
            state, difference = parity(name, options, factory, ddp_options, batch=1, tolerance=1e-5, steps=steps)
            rate, before, after = state.compression_stats()
            assert before > 0 and after < before, "%s: nothing was compressed (%s)" % (name, (rate, before, after))
            assert state.bytes_sent() > 0
            if rank() == 0:
                print("%s: largest parameter difference from DDP allreduce %.2g over %d steps, compression rate "
                      "%.2f" % (name, difference, steps, rate))


def case_low_rank():
    # A noisy linear regression with a full-rank 16 x 8 map: rank 1 cannot carry a step's gradient; error
    # feedback delivers the rest in later steps, so the loss follows allreduce's down to the noise floor.
    steps = 40
    torch.manual_seed(3)
    teacher = torch.randn(16, 8)
    generator = torch.Generator().manual_seed(40 + rank())
    inputs = [torch.randn(32, 16, generator=generator) for _ in range(steps)]
    targets = [x @ teacher + 0.5 * torch.randn(32, 8, generator=generator) for x in inputs]
    torch.manual_seed(4)
    reference = nn.Sequential(nn.Linear(16, 8))
    ours = copy.deepcopy(reference)
    plain_losses = train(ddp(reference), inputs, targets, lr=LOW_RANK_LR)
    model = ddp(ours)
    state = pst.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=3,
                              min_compression_rate=0)
    model.register_comm_hook(state, pst.powerSGD_hook)
    our_losses = train(model, inputs, targets, lr=LOW_RANK_LR)
    assert state.compression_stats()[1] > 0, "nothing was compressed"
    if rank() == 0:
        print("low-rank: loss (rank 0's batch) every 5 steps, allreduce vs powersgd rank 1 with error feedback:")
        for i in range(0, steps, 5):
            print("  step %2d  %.4f  %.4f" % (i, plain_losses[i], our_losses[i]))
    # Both reach the noise floor (0.25): the mean of the last 10 losses within 1.3x of allreduce's.
    tail_plain = sum(plain_losses[-10:]) / 10
    tail_ours = sum(our_losses[-10:]) / 10
    assert tail_plain < plain_losses[0] / 10, plain_losses
    assert tail_ours < 1.3 * tail_plain, (tail_ours, tail_plain, our_losses)


class Residual(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + 0.1 * torch.tanh(self.linear(x))


def case_many_buckets():
    def make():
        torch.manual_seed(5)
        return nn.Sequential(*[Residual(256) for _ in range(14)], nn.Linear(256, 8))

    # DDP's first bucket holds up to 1 MiB, the others bucket_cap_mb: 14 layers of 256 KiB make 12+ buckets.
    options = dict(bucket_cap_mb=0.25)
    generator = torch.Generator().manual_seed(60 + rank())
    x = torch.randn(16, 256, generator=generator)
    y = torch.randn(16, 8, generator=generator)
    steps = 20
    plain_losses = train(ddp(make(), **options), [x] * steps, [y] * steps, lr=0.2)
    model = make()
    net = ddp(model, **options)
    state = pst.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=3)
    buckets = set()

    def counting_hook(s, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buckets.add(bucket.index())
        return pst.powerSGD_hook(s, bucket)

    net.register_comm_hook(state, counting_hook)
    # One batch per rank, repeated: the loss falls under any working reduction.
    losses = train(net, [x] * steps, [y] * steps, lr=0.2)
    assert len(buckets) >= 10, "only %d DDP buckets" % len(buckets)
    assert state.compression_stats()[1] > 0
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world())]
    dist.all_gather(gathered, flat)
    for other in gathered:
        assert torch.equal(other, flat), "ranks hold different parameters"
    # At least half of allreduce's decrease of the loss.
    assert plain_losses[0] - losses[-1] > 0.5 * (plain_losses[0] - plain_losses[-1]), (losses, plain_losses)
    if rank() == 0:
        print("many-buckets: %d DDP buckets, loss %.4f -> %.4f in %d steps (allreduce: -> %.4f), "
              "compression rate %.1f" % (len(buckets), losses[0], losses[-1], steps, plain_losses[-1],
                                         state.compression_stats()[0]))

    # The whole-bucket variant on the same buckets (PyTorch's fails an assertion on such layouts).
    model = make()
    net = ddp(model, **options)
    state = pst.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=3)
    net.register_comm_hook(state, pst.batched_powerSGD_hook)
    losses = train(net, [x] * steps, [y] * steps, lr=0.2)
    assert state.compression_stats()[1] > 0
    assert losses[-1] < 0.5 * losses[0], losses
    if rank() == 0:
        print("many-buckets, batched_powerSGD_hook: loss %.4f -> %.4f in %d steps, compression rate %.1f"
              % (losses[0], losses[-1], steps, state.compression_stats()[0]))


def case_groups():
    # Every rank creates every group, in the same order (torch.distributed.new_group is collective).
    members = [[r for r in range(world()) if r % 2 == parity] for parity in (0, 1)]
    groups = [dist.new_group(ranks) for ranks in members]
    group = groups[rank() % 2]
    others = groups[1 - rank() % 2]  # NON_GROUP_MEMBER here
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as reference_hooks

    # One sample per rank: each weight gradient's mean over a group of n ranks has rank <= n, so PowerSGD at
    # rank n reproduces it (see case_parity_exact; at a rank above the gradient's, both hooks orthogonalize
    # rounding noise); both hooks compress from iteration 3.
    assert world() in (2, 4)
    steps = 12
    settings = dict(matrix_approximation_rank=dist.get_world_size(group), start_powerSGD_iter=pst.DECLARATION_ITER,
                    use_error_feedback=False, warm_start=True)
    torch.manual_seed(1)
    initial = TwoLayers()
    inputs, targets = data(1, steps, seed=9)

    theirs = copy.deepcopy(initial)
    model = ddp(theirs, process_group=group)
    model.register_comm_hook(reference_hooks.PowerSGDState(process_group=group, **settings),
                             reference_hooks.powerSGD_hook)
    train(model, inputs, targets)

    ours = copy.deepcopy(initial)
    model = ddp(ours, process_group=group)
    state = pst.PowerSGDState(process_group=group, **settings)
    model.register_comm_hook(state, pst.powerSGD_hook)
    train(model, inputs, targets)
    assert state.compression_stats()[1] > 0, "nothing was compressed"

    # The engine's communicator for the group: its members only, this rank at its place in the group.
    from powersgd import _capi
    comm = pst._comms[tuple(members[rank() % 2])]
    assert (_capi.lib.psgd_comm_rank(comm), _capi.lib.psgd_comm_size(comm)) == (
        dist.get_rank(group), dist.get_world_size(group)), "the engine's group communicator"
    # And the whole job's beside it (under torchrun's variables rank 0 hosts the store once, in the group's).
    _capi.check(_capi.lib.psgd_comm_barrier(pst._engine_comm()))

    # What an average over every rank gives: the check below can tell the two apart.
    everyone = copy.deepcopy(initial)
    train(ddp(everyone), inputs, targets)

    difference = check_close("groups", ours, theirs, 1e-5, reference="PyTorch's powerSGD_hook's")
    apart = max((a - b).abs().max().item() for a, b in zip(everyone.parameters(), theirs.parameters()))
    assert apart > 1e-3, "the group's run and the whole job's differ by only %g" % apart
    flat = torch.cat([p.detach().reshape(-1) for p in ours.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flat, group=group)
    for other in gathered:
        assert torch.equal(other, flat), "the group's members hold different parameters"
    if rank() == 0:
        print("groups: %d ranks in groups %s; largest parameter difference from PyTorch's powerSGD_hook %.2g "
              "over %d steps; an average over every rank would be %.3g away"
              % (world(), members, difference, steps, apart))

    # A group this rank is not in, and anything that is not a process group: refused at construction.
    for bad, words in [(others, "not a member"), ("world", "'world'")]:
        try:
            pst.PowerSGDState(process_group=bad)
        except ValueError as e:
            assert words in str(e), e
        else:
            raise AssertionError("PowerSGDState(process_group=%r) accepted" % (bad,))
    # The C function behind it refuses what names no place in a group, before any rendezvous.
    for args, words in [((2, 2, b"ranks-0,1"), "rank 2 in group 'ranks-0,1': expected 0 to 1"),
                        ((0, world() + 1, b"ranks-x"), "group size %d: expected 1 to" % (world() + 1)),
                        ((0, 1, b""), "group_id ''"), ((0, 1, b"a b"), "group_id 'a b'")]:
        handle = ctypes.c_void_p()
        status = _capi.lib.psgd_comm_init_group(*args, ctypes.byref(handle))
        assert status == 1 and words in _capi.last_error() and not handle, (args, status, _capi.last_error())


def expect_failure(what, fn, words):
    try:
        fn()
    except RuntimeError as e:
        message = str(e)
        for word in words:
            if word not in message:
                raise AssertionError("%s: the error does not name %r: %s" % (what, word, message))
        return message
    raise AssertionError("%s: no error" % what)


class FakeBucket:
    """The four methods of dist.GradBucket that the hook calls, over a tensor this test controls."""

    def __init__(self, index, shapes, last):
        self._index, self._last = index, last
        self._buffer = torch.ones(sum(torch.Size(s).numel() for s in shapes))
        self._shapes = shapes

    def index(self):
        return self._index

    def buffer(self):
        return self._buffer

    def gradients(self):
        views, offset = [], 0
        for s in self._shapes:
            n = torch.Size(s).numel()
            views.append(self._buffer[offset:offset + n].view(s))
            offset += n
        return views

    def is_last(self):
        return self._last


def case_errors():
    # NaN in one rank's gradients during compressed steps: backward() raises on every rank, naming it.
    torch.manual_seed(7)
    model = ddp(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)))
    state = pst.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=4)
    model.register_comm_hook(state, pst.powerSGD_hook)
    inputs, targets = data(4, 6, seed=8)
    train(model, inputs, targets)
    bad = inputs[0].clone()
    if rank() == world() - 1:
        bad[0, 0] = float("nan")
    message = expect_failure("NaN gradients", lambda: nn.functional.mse_loss(model(bad), targets[0]).backward(),
                             ["PSGD_ERR_NONFINITE", "NaN or Inf"])
    if rank() == 0:
        print("errors: NaN gradients ->", message.splitlines()[0][:200])

    # A layout that changes after the declaration (buckets driven by hand through the hook's interface).
    state = pst.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=0)
    layout = [[(8, 4), (8,)], [(6, 6)]]
    for iteration in range(pst.DECLARATION_ITER + 1):
        futures = [pst.powerSGD_hook(state, FakeBucket(i, shapes, i == len(layout) - 1))
                   for i, shapes in enumerate(layout)]
        for f in futures:
            f.wait()
    assert state.iter == pst.DECLARATION_ITER + 1
    changed = pst.powerSGD_hook(state, FakeBucket(0, [(4, 8), (8,)], False))
    message = expect_failure("layout change", changed.wait, ["PSGD_ERR_MISMATCH", "bucket 0 changed",
                                                               "(4, 8)", "(8, 4)"])
    later = pst.powerSGD_hook(state, FakeBucket(1, layout[1], True))
    expect_failure("after a layout change", later.wait, ["bucket 0 changed"])
    if rank() == 0:
        print("errors: layout change ->", message[:200])

    # One state serves one hook.
    state = pst.PowerSGDState(process_group=None, start_powerSGD_iter=0)
    for iteration in range(pst.DECLARATION_ITER):
        pst.powerSGD_hook(state, FakeBucket(0, [(8, 8)], True)).wait()
    pst.powerSGD_hook(state, FakeBucket(0, [(8, 8)], True)).wait()
    expect_failure("two hooks", pst.batched_powerSGD_hook(state, FakeBucket(0, [(8, 8)], True)).wait,
                   ["use one state per hook"])

    # Bad configuration fails in the constructor, naming the value.
    for options, words in [(dict(matrix_approximation_rank=0), "matrix_approximation_rank = 0"),
                           (dict(use_error_feedback=2), "use_error_feedback = 2"),
                           (dict(start_powerSGD_iter=-1), "start_powerSGD_iter = -1")]:
        try:
            pst.PowerSGDState(None, **options)
        except ValueError as e:
            assert words in str(e), e
        else:
            raise AssertionError("%s accepted" % options)
    # The engine's own validation (rank above its limit) fails at the declaration, from the future.
    state = pst.PowerSGDState(process_group=None, matrix_approximation_rank=1000, start_powerSGD_iter=0)
    for iteration in range(pst.DECLARATION_ITER):
        pst.powerSGD_hook(state, FakeBucket(0, [(8, 8)], True)).wait()
    expect_failure("rank 1000", pst.powerSGD_hook(state, FakeBucket(0, [(8, 8)], True)).wait,
                   ["PSGD_ERR_INVALID_ARGUMENT", "1000"])


CASES = {
    "parity-plain": case_parity_plain,
    "parity-exact": case_parity_exact,
    "low-rank": case_low_rank,
    "many-buckets": case_many_buckets,
    "errors": case_errors,
    "groups": case_groups,
}


def main():
    if len(sys.argv) != 2 or sys.argv[1] not in CASES:
        print("usage: ddp_hook.py {%s}" % ",".join(CASES), file=sys.stderr)
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
