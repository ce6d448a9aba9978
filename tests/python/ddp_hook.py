"""powersgd.torch under real DDP (Gloo, CPU), every rank of a powersgd-run job runs one case:

    powersgd-run -n 2 -- python3 tests/python/ddp_hook.py CASE

Cases (PyTorch's own parity check for comm hooks, ported to CPU):
  parity-plain      start_powerSGD_iter beyond the run: parameters equal DDP allreduce's to 1e-5
  parity-exact      the mean gradient has rank <= r (batch of 1 per rank, 2 ranks, r = 2), compressed from
                    iteration 2 with error feedback: parameters equal DDP allreduce's to 1e-5; the same with
                    gradient_as_bucket_view, static_graph, find_unused_parameters (an unused layer)
  low-rank          rank 1 with error feedback on a regression task: the loss curve follows allreduce's
  many-buckets      a model in 12+ DDP buckets trains (loss falls), compressed, parameters equal on all ranks
  groups            two disjoint process groups (ranks of equal parity: {0, 2} and {1, 3}, or {0} and {1}), DDP
                    on each with our hook and with PyTorch's powerSGD_hook at an exact rank: the same parameters
                    (and not those of an average over every rank); a group this rank is not in is refused
  validation        every bad PowerSGDState argument fails at construction (TypeError/ValueError naming it and
                    the accepted range), and the engine refuses the same value in its psgd_config; the extremes
                    are accepted by both
  knobs             compression stats logged at compression_stats_logging_frequency with PyTorch's wording;
                    adaptive (rank_low, rank_high, adaptive_interval, adaptive_threshold) and alternating reach
                    the engine (bytes per step); the process group's timeout is the engine's (3 ranks)
  dtype-float64, dtype-float16
                    DDP on a model of that dtype: parameters equal DDP allreduce's in that dtype within a
                    tolerance of the dtype (exact low-rank setting of parity-exact)
  dtype-bfloat16    bfloat16 buckets (by hand: torch 1.13's Gloo has none) give the float32 results rounded
  timing            the reduction's timing breakdown (PowerSGDState.timing_breakdown()) of a model in several
                    buckets: one record per compressed step, every part >= 0, the tail exactly the sum of its
                    four parts, the engine's kinds within its busy time, no copies for float32 buckets; a
                    failed step is not recorded; the PSGD_TORCH_TIMING log line; a bad PSGD_TORCH_TIMING
                    fails the import, naming it
  lr-watch          PowerSGDState(lr_watch=optimizer): each StepLR decay is exactly one note_lr_change on every
                    rank, which boosts every bucket to rank_high for lr_boost_steps steps (the decision log, equal on
                    both ranks); warmup_steps/lr_boost_steps are validated
  two-models        two DDP models in one process group, each with its own PowerSGDState (one inside the
                    other's forward, so their hooks and engine reductions interleave in one backward): every
                    parameter equal on all ranks, bitwise, and DDP allreduce's to 1e-5 (exact low-rank setting)
  errors            NaN gradients and a bucket layout changing after the declaration fail from the future /
                    backward() with PowerSGDError naming the failure, on every rank, without hanging
  checkpoint-rank0  PyTorch's tutorial pattern: rank 0 alone saves (model, optimizer, PowerSGDState) at once;
                    every rank resumes from that file (error memory zero, warm start and counters continued);
                    job_state_dict() (collective) gives the ranks' mean error memory
  schedule          compression starts at start_powerSGD_iter (2) with DDP's default, static_graph and
                    gradient_as_bucket_view; a resume from a checkpoint taken before compression starts is bitwise
                    the uninterrupted run; decisions() reports DDP's iteration
  user-terms        TypeError says 'an integer' once; arguments differing between ranks fail every rank, named as
                    PowerSGDState's with each rank's value; pickling logs nothing; an engine error is not printed
                    on stderr besides the exception
  supported         docs/torch.md's "What is supported" states each claim; a GAN (two states) trains; DDP refuses
                    a bfloat16 model
  load-refusal      into running engines, a dict that one rank refuses before the engine's agreement (saved before
                    the declaration, other declared buckets, a mangled engine entry), or a job checkpoint only on
                    one rank where the other holds its own data (no kind every rank loads): every rank raises within
                    seconds (PSGD_TIMEOUT_MS 10 s; the others waited for all of it), nothing changes, training goes on
  store-interrupt   a KeyboardInterrupt in a store callback during the engine's rendezvous is raised by it
                    once the library returned; no exception crosses into the library
  unused-branch     a branch unused (find_unused_parameters=True), or scaled by 0.0, in the first compressed
                    steps and used from step 6: its gradient is nonzero afterwards and comparable to DDP
                    allreduce's (it stayed 0 for good when the zero step froze the warm-start factor)
With POWERSGD_TEST_TORCH_INIT=1 the process group comes from torch.distributed.init_process_group("gloo")
itself (env://), as in a script written for torchrun; else from powersgd.torch.init_process_group.
Exit 77 (skip) when torch is not importable.
"""
import copy
import ctypes
import datetime
import logging
import math
import os
import pickle
import sys
import time

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
    # error feedback the check covers the first 4 compressed steps (iterations 2 to 5), where the drift is
    # still below 1e-5.
    for error_feedback, warm_start, steps in [(False, True, STEPS), (False, False, STEPS), (True, True, 6),
                                              (True, False, 6)]:
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

    # PyTorch's reload pattern: torch.load(state) gives the default group, then the group is set. The
    # assignment changed torch's collectives only, and the engine averaged over every rank (0.3 away).
    restored = pickle.loads(pickle.dumps(pst.PowerSGDState(process_group=group, **settings)))
    restored.process_group = group
    reloaded = copy.deepcopy(initial)
    model = ddp(reloaded, process_group=group)
    model.register_comm_hook(restored, pst.powerSGD_hook)
    train(model, inputs, targets)
    check_close("groups, the group set after unpickling", reloaded, theirs, 1e-5,
                reference="PyTorch's powerSGD_hook's")
    # Once the engine reducer exists its communicator serves that group: another is refused, the same kept.
    restored.process_group = group
    try:
        restored.process_group = None
    except ValueError as e:
        assert "cannot change once the engine reducer exists" in str(e), e
    else:
        raise AssertionError("process_group changed under a running reducer")
    assert restored.process_group is group

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
    """The five methods of dist.GradBucket that the hook calls, over a tensor this test controls (and
    parameters of the gradients' shapes, which the hook names for checkpoints)."""

    parameters_of = {}

    def __init__(self, index, shapes, last, dtype=torch.float32):
        self._index, self._last = index, last
        self._buffer = torch.ones(sum(torch.Size(s).numel() for s in shapes), dtype=dtype)
        self._shapes = shapes
        # The same parameters for the same bucket in every iteration, as DDP's (the hook names them).
        key = (index, tuple(tuple(s) for s in shapes))
        self._parameters = FakeBucket.parameters_of.setdefault(key, [torch.zeros(s) for s in shapes])

    def parameters(self):
        return self._parameters

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
    state = pst.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                              start_powerSGD_iter=pst.DECLARATION_ITER)
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
    state = pst.PowerSGDState(process_group=None, start_powerSGD_iter=pst.DECLARATION_ITER)
    for iteration in range(pst.DECLARATION_ITER):
        pst.powerSGD_hook(state, FakeBucket(0, [(8, 8)], True)).wait()
    pst.powerSGD_hook(state, FakeBucket(0, [(8, 8)], True)).wait()
    expect_failure("two hooks", pst.batched_powerSGD_hook(state, FakeBucket(0, [(8, 8)], True)).wait,
                   ["use one state per hook"])

    # The same in the process's first iterations (reduced at the last bucket through the declared buckets):
    # that step fails, and the next ones train (before, every later bucket failed with it, state_dict too).
    # Several buckets: the step's other buckets are still reduced after one failed (the next iteration's first was
    # refused as "already reduced in step 2", and that failure stuck).
    first_bucket_bytes = dist._DEFAULT_FIRST_BUCKET_BYTES
    model = ckpt_ddp(ckpt_model())  # two buckets once DDP rebuilt them
    state = pst.PowerSGDState(process_group=None, start_powerSGD_iter=2)
    model.register_comm_hook(state, pst.powerSGD_hook)
    train(model, inputs[:2], targets[:2])
    assert state._local_iter < pst.DECLARATION_ITER, state._local_iter
    expect_failure("NaN gradients, deferred", lambda: nn.functional.mse_loss(model(bad), targets[2]).backward(),
                   ["PSGD_ERR_NONFINITE", "NaN or Inf"])
    assert len(state._declared) >= 2, state._declared
    before = state.compression_stats()[1]
    train(model, inputs[3:], targets[3:])
    assert state.compression_stats()[1] > before and state._failure is None, (state.compression_stats(),
                                                                               state._failure)
    state.state_dict()
    dist._DEFAULT_FIRST_BUCKET_BYTES = first_bucket_bytes  # read when DDP rebuilds its buckets
    # An error goes between processes whole (pickled with its arguments, not its formatted message alone).
    error = pickle.loads(pickle.dumps(pst.PowerSGDError(3, "x")))
    assert isinstance(error, pst.PowerSGDError) and str(error) == str(pst.PowerSGDError(3, "x")), error

    # An attribute changed to a bad value after construction fails at the declaration through the futures, on
    # every rank, and every later iteration with it; DDP stays usable. Raised from the hook into DDP instead, it
    # left DDP unable to run another backward (INTERNAL ASSERT FAILED) and the iteration open.
    torch.manual_seed(7)
    model = ddp(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)))
    state = pst.PowerSGDState(process_group=None, start_powerSGD_iter=4)
    model.register_comm_hook(state, pst.powerSGD_hook)
    inputs, targets = data(4, 6, seed=8)
    train(model, inputs[:4], targets[:4])
    state.matrix_approximation_rank = 100
    for step in (4, 5):
        message = expect_failure("a bad attribute", lambda: nn.functional.mse_loss(model(inputs[step]),
                                                                                   targets[step]).backward(),
                                 ["matrix_approximation_rank = 100"])
        assert "INTERNAL ASSERT" not in message, message
        assert not state._layout and state.iter == step + 1, (state._layout, state.iter)
    if rank() == 0:
        print("errors: a bad attribute ->", message.splitlines()[0][:200])

    # Bad configuration fails in the constructor, naming the value (every argument: case_validation).
    for options, words in [(dict(matrix_approximation_rank=0), "matrix_approximation_rank = 0"),
                           (dict(use_error_feedback=2), "use_error_feedback = 2"),
                           (dict(start_powerSGD_iter=-1), "start_powerSGD_iter = -1")]:
        try:
            pst.PowerSGDState(None, **options)
        except ValueError as e:
            assert words in str(e), e
        else:
            raise AssertionError("%s accepted" % options)


# PowerSGDState argument -> the psgd_config field the engine validates it as.
ENGINE_FIELD = {"matrix_approximation_rank": "rank", "start_powerSGD_iter": "start_iter",
                "min_compression_rate": "min_compression_rate", "use_error_feedback": "error_feedback",
                "warm_start": "warm_start", "orthogonalization_epsilon": "orthogonalization_epsilon",
                "random_seed": "seed", "batch_tensors_with_same_shape": "batch_same_shape", "adaptive": "adaptive",
                "rank_low": "rank_low", "rank_high": "rank_high", "adaptive_interval": "adaptive_interval",
                "adaptive_threshold": "adaptive_threshold", "alternating": "alternating",
                "divergence_check_interval": "divergence_check_interval"}


def engine_accepts(options):
    """Whether the engine's psgd_reducer_create accepts the configuration (no collective: it validates and
    starts the reducer's thread), and its message."""
    from powersgd import _capi
    config = _capi.default_config()
    for name, value in options.items():
        setattr(config, ENGINE_FIELD[name], value)
    reducer = ctypes.c_void_p()
    status = _capi.lib.psgd_reducer_create(pst._engine_comm(), ctypes.byref(config), ctypes.byref(reducer))
    if status == 0:
        _capi.lib.psgd_reducer_destroy(reducer)
        return True, ""
    assert status == 1 and not reducer, (options, status)
    return False, _capi.last_error()


def case_validation():
    # Each bad value: refused at construction, naming the argument, the value and the range; and refused by
    # the engine in its config, so the hook's ranges are the engine's (none narrower, none wider).
    nan, inf = float("nan"), float("inf")
    bad = [
        (dict(matrix_approximation_rank=65), ValueError, ["matrix_approximation_rank = 65", "1 to 64"]),
        (dict(matrix_approximation_rank=0), ValueError, ["matrix_approximation_rank = 0", "1 to 64"]),
        (dict(start_powerSGD_iter=-1), ValueError, ["start_powerSGD_iter = -1", ">= 0"]),
        (dict(min_compression_rate=-1), ValueError, ["min_compression_rate = -1", "finite value >= 0"]),
        (dict(min_compression_rate=nan), ValueError, ["min_compression_rate = nan", "finite"]),
        (dict(min_compression_rate=inf), ValueError, ["min_compression_rate = inf", "finite"]),
        (dict(orthogonalization_epsilon=-1e-8), ValueError,
         ["orthogonalization_epsilon = -1e-08", "expected 0 or a float"]),
        (dict(orthogonalization_epsilon=inf), ValueError, ["orthogonalization_epsilon = inf", "expected 0 or a float"]),
        (dict(use_error_feedback=2), ValueError, ["use_error_feedback = 2", "True or False"]),
        (dict(warm_start=-1), ValueError, ["warm_start = -1", "True or False"]),
        (dict(batch_tensors_with_same_shape=2), ValueError, ["batch_tensors_with_same_shape = 2"]),
        (dict(adaptive=2), ValueError, ["adaptive = 2", "True or False"]),
        (dict(alternating=2), ValueError, ["alternating = 2", "True or False"]),
        (dict(rank_low=0), ValueError, ["rank_low = 0", "1 to 64"]),
        (dict(rank_high=65), ValueError, ["rank_high = 65", "1 to 64"]),
        (dict(rank_low=5, rank_high=4), ValueError, ["rank_low = 5 > rank_high = 4"]),
        (dict(adaptive_interval=0), ValueError, ["adaptive_interval = 0", ">= 1"]),
        (dict(adaptive_threshold=-0.5), ValueError, ["adaptive_threshold = -0.5", ">= 0"]),
        (dict(adaptive_threshold=nan), ValueError, ["adaptive_threshold = nan", "finite"]),
        (dict(alternating=True, warm_start=False), ValueError, ["alternating = 1 with warm_start = 0"]),
        (dict(divergence_check_interval=-1), ValueError, ["divergence_check_interval = -1", ">= 0"]),
    ]
    for options, kind, words in bad:
        try:
            pst.PowerSGDState(None, **options)
        except kind as e:
            for word in words:
                assert word in str(e), (options, word, str(e))
        else:
            raise AssertionError("PowerSGDState(%s) accepted" % options)
        accepted, message = engine_accepts(options)
        assert not accepted, "the engine accepts %s, which PowerSGDState refuses" % options
    # Values C cannot hold: refused by type or range before they reach the config.
    for options, kind, words in [(dict(matrix_approximation_rank=2.0), TypeError, ["matrix_approximation_rank = 2.0",
                                                                                   "an integer"]),
                                 (dict(matrix_approximation_rank=True), TypeError, ["matrix_approximation_rank"]),
                                 (dict(random_seed=-1), ValueError, ["random_seed = -1", "0 to 2**64 - 1"]),
                                 (dict(random_seed=2**64), ValueError, ["random_seed = 18446744073709551616"]),
                                 (dict(min_compression_rate="2"), TypeError, ["min_compression_rate = '2'"]),
                                 (dict(compression_stats_logging_frequency=1.5), TypeError,
                                  ["compression_stats_logging_frequency = 1.5"])]:
        try:
            pst.PowerSGDState(None, **options)
        except kind as e:
            for word in words:
                assert word in str(e), (options, word, str(e))
        else:
            raise AssertionError("PowerSGDState(%s) accepted" % options)
    # The extremes: accepted by both.
    # PyTorch's rule (a PowerSGDState rule, not the engine's): start_powerSGD_iter > 1 with error feedback or
    # warm start, which cannot follow DDP's rebuild of its buckets after iteration 0.
    for options in (dict(start_powerSGD_iter=0), dict(start_powerSGD_iter=1, use_error_feedback=False),
                    dict(start_powerSGD_iter=1, warm_start=False)):
        try:
            pst.PowerSGDState(None, **options)
        except ValueError as e:
            expected = "start_powerSGD_iter = %d: expected > 1 with use_error_feedback or warm_start" % (
                options["start_powerSGD_iter"])
            assert expected in str(e), str(e)
        else:
            raise AssertionError("PowerSGDState(%s) accepted" % options)
    good = [dict(matrix_approximation_rank=64), dict(matrix_approximation_rank=1), dict(start_powerSGD_iter=2),
            dict(start_powerSGD_iter=0, use_error_feedback=False, warm_start=False),
            dict(min_compression_rate=0), dict(orthogonalization_epsilon=0), dict(random_seed=2**64 - 1),
            dict(adaptive=True, rank_low=64, rank_high=64, adaptive_interval=1, adaptive_threshold=0),
            dict(alternating=True), dict(use_error_feedback=False, warm_start=False), dict(divergence_check_interval=0)]
    for options in good:
        state = pst.PowerSGDState(None, **options)
        assert engine_accepts(options)[0], options
        state.close()
    # Every psgd_config field is set from an argument (but struct_size, whole_bucket, chosen by the hook, and
    # device, device_index: CPU only): a value other than the default reaches the engine's config.
    from powersgd import _capi
    others = {"struct_size", "whole_bucket", "device", "device_index"}
    values = dict(matrix_approximation_rank=3, start_powerSGD_iter=5, min_compression_rate=3.0,
                  use_error_feedback=False, warm_start=False, orthogonalization_epsilon=1e-6, random_seed=9,
                  batch_tensors_with_same_shape=True, adaptive=True, rank_low=2, rank_high=5, adaptive_interval=7,
                  adaptive_threshold=0.25, alternating=True, divergence_check_interval=7, warmup_steps=3,
                  lr_boost_steps=4, wire_dtype="bf16")
    fields = dict(ENGINE_FIELD, warmup_steps="warmup_steps", lr_boost_steps="lr_boost_steps", wire_dtype="wire_dtype")
    assert {name for name, _ in _capi.Config._fields_} - others == set(fields.values())
    defaults = _capi.default_config()
    for argument, value in values.items():
        config = pst.PowerSGDState(None, **{argument: value})._engine_config(whole_bucket=False)
        got, default = getattr(config, fields[argument]), getattr(defaults, fields[argument])
        assert got != default, (argument, got, default)
    # PyTorch's: at least 1.
    assert pst.PowerSGDState(None, compression_stats_logging_frequency=0).compression_stats_logging_frequency == 1
    if rank() == 0:
        print("validation: %d bad values refused at construction and by the engine; %d extremes accepted by both"
              % (len(bad), len(good)))


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def step_bytes(options, steps, shapes=((64, 64),)):
    """Drives the hook by hand over one bucket for `steps` compressed steps; the engine's bytes of the last."""
    state = pst.PowerSGDState(None, start_powerSGD_iter=pst.DECLARATION_ITER, **options)
    for _ in range(pst.DECLARATION_ITER + steps):
        bucket = FakeBucket(0, list(shapes), True)
        torch.manual_seed(rank())
        bucket.buffer().copy_(torch.randn(bucket.buffer().shape))
        pst.powerSGD_hook(state, bucket).wait()
    assert state.compression_stats()[1] > 0
    result = state._stats().last_step_bytes
    state.close()
    return result


def case_knobs():
    assert world() == 3
    # Statistics logged as PyTorch's hook does: from the first compressed iteration, every N iterations, at the
    # iteration's last bucket, after its reductions.
    records = Records()
    logging.getLogger("powersgd.torch").addHandler(records)
    logging.getLogger("powersgd.torch").setLevel(logging.INFO)
    torch.manual_seed(1)
    model = ddp(TwoLayers())
    state = pst.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=4,
                              compression_stats_logging_frequency=3)
    model.register_comm_hook(state, pst.powerSGD_hook)
    inputs, targets = data(2, 11, seed=3)
    train(model, inputs, targets)
    rate, before, after = state.compression_stats()
    state.close()
    logging.getLogger("powersgd.torch").removeHandler(records)
    reports = [m for m in records.messages if m.startswith("Compression stats")]
    assert [m.split(",")[0] for m in reports] == ["Compression stats: iter 4", "Compression stats: iter 7",
                                                  "Compression stats: iter 10"], records.messages
    assert reports[-1] == ("Compression stats: iter 10, total before compression %d, total after compression %d, "
                           "rate %s" % (before, after, rate)), (reports[-1], state.compression_stats())
    assert records.messages[0].startswith("PowerSGD config: matrix_approximation_rank = 1; start_powerSGD_iter = 4")
    assert "Start to apply PowerSGD after 4 iterations." in records.messages, records.messages

    # Adaptive rank and alternating reach the engine: bytes of a step of one 64 x 64 matrix.
    rank1 = step_bytes(dict(matrix_approximation_rank=1), 3)
    rank4 = step_bytes(dict(matrix_approximation_rank=4), 3)
    assert rank4 > 3 * rank1, (rank1, rank4)
    # A window changing by less than the threshold -> rank_low for the next; threshold 0 -> rank_high always.
    assert step_bytes(dict(adaptive=True, rank_low=1, rank_high=4, adaptive_threshold=0, adaptive_interval=1),
                      4) == rank4
    assert step_bytes(dict(adaptive=True, rank_low=1, rank_high=4, adaptive_threshold=1e9, adaptive_interval=1),
                      4) == rank1
    assert step_bytes(dict(adaptive=True, rank_low=1, rank_high=4, adaptive_threshold=1e9, adaptive_interval=100),
                      4) == rank4  # the first window (100 steps) is at rank_high
    assert step_bytes(dict(adaptive=True, rank_low=2, rank_high=2), 3) == step_bytes(
        dict(matrix_approximation_rank=2), 3)
    alternating = step_bytes(dict(matrix_approximation_rank=4, alternating=True), 3)
    assert alternating < rank4 and abs(alternating - rank4 / 2) <= rank4 / 8, (alternating, rank4)

    # The process group's timeout is the engine's: group {0, 1} with 3 s; rank 1 stalls, rank 0's collective
    # of the group's engine communicator fails with a timeout after about 3 s, not PSGD_TIMEOUT_MS's 300 s.
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
    if rank() < 2:
        from powersgd import _capi
        comm = pst._engine_comm(pst._group_of(group), pst._group_timeout(group))
        _capi.check(_capi.lib.psgd_comm_barrier(comm))
        if rank() == 1:
            time.sleep(10)
        start = time.monotonic()
        status = _capi.lib.psgd_comm_barrier(comm)
        waited = time.monotonic() - start
        if rank() == 0:
            assert status == 3 and "PSGD_TIMEOUT_MS" in _capi.last_error(), (status, _capi.last_error())
            assert 2.5 < waited < 9, waited
            print("knobs: the group's 3 s timeout: the engine's barrier failed after %.1f s" % waited)
        else:
            assert status != 0
    if rank() == 0:
        print("knobs: stats logged at iterations 4, 7, 10; bytes per step: rank 1 %d, rank 4 %d, alternating "
              "rank 4 %d" % (rank1, rank4, alternating))


class HalfLinear(nn.Module):
    """A linear layer whose parameters have `dtype` (float16: torch 1.13 has no float16 matmul on the CPU, so
    it computes in float32; the gradients are float16, as the parameters)."""

    def __init__(self, rows, cols, dtype, bias=True):
        super().__init__()
        self.weight = nn.Parameter((torch.randn(rows, cols) / math.sqrt(cols)).to(dtype))
        self.bias = nn.Parameter(torch.zeros(rows, dtype=dtype)) if bias else None

    def forward(self, x):
        y = x @ self.weight.float().t()
        return y + self.bias.float() if self.bias is not None else y


def case_dtype(dtype, tolerance):
    def factory():
        return nn.Sequential(HalfLinear(32, 16, dtype, bias=False), nn.ReLU(), HalfLinear(8, 32, dtype))

    options = dict(matrix_approximation_rank=2, start_powerSGD_iter=2, use_error_feedback=False)
    name = "dtype-%s" % str(dtype).split(".")[1]
    state, difference = parity(name, options, factory, {}, batch=1, tolerance=tolerance)
    assert all(p.dtype == dtype for p in state_model_parameters(factory))
    assert state.compression_stats()[1] > 0, "nothing was compressed"
    if rank() == 0:
        print("%s: largest parameter difference from DDP allreduce in %s %.2g over %d steps (tolerance %g)"
              % (name, dtype, difference, STEPS, tolerance))


def case_bfloat16():
    # torch 1.13's Gloo has no bfloat16 ("Invalid scalar type": DDP's constructor cannot broadcast a bfloat16
    # model), so the hook gets bfloat16 buckets by hand: two states, one fed float32 buckets, one the same
    # values in bfloat16 (exact: they are bfloat16 values) from the compressed steps on; the engine computes
    # the same float32 result for both, which the second returns rounded to bfloat16.
    options = dict(matrix_approximation_rank=2, start_powerSGD_iter=pst.DECLARATION_ITER)
    shapes = [(32, 16), (16,)]
    plain, converted = pst.PowerSGDState(None, **options), pst.PowerSGDState(None, **options)
    generator = torch.Generator().manual_seed(70 + rank())
    for iteration in range(pst.DECLARATION_ITER + 4):
        values = torch.randn(32 * 16 + 16, generator=generator).to(torch.bfloat16).float()
        a = FakeBucket(0, shapes, True)
        a.buffer().copy_(values)
        b = FakeBucket(0, shapes, True, torch.bfloat16 if iteration >= pst.DECLARATION_ITER else torch.float32)
        b.buffer().copy_(values)
        pst.powerSGD_hook(plain, a).wait()
        result = pst.powerSGD_hook(converted, b).wait()
        assert result.dtype == b.buffer().dtype and result.data_ptr() == b.buffer().data_ptr()
        assert torch.equal(b.buffer(), a.buffer().to(b.buffer().dtype)), iteration
        assert not torch.equal(a.buffer(), values)
    assert converted.compression_stats() == plain.compression_stats() and plain.compression_stats()[1] > 0
    if rank() == 0:
        print("dtype-bfloat16: 4 compressed steps of bfloat16 buckets equal the float32 results rounded")


def case_timing():
    import os
    import subprocess
    from powersgd import _timing

    def make():
        torch.manual_seed(5)
        return nn.Sequential(*[Residual(256) for _ in range(6)], nn.Linear(256, 8))

    generator = torch.Generator().manual_seed(70 + rank())
    x = torch.randn(16, 256, generator=generator)
    y = torch.randn(16, 8, generator=generator)
    net = ddp(make(), bucket_cap_mb=0.25)
    state = pst.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=3)
    assert state.timing_breakdown() == {"steps": 0}, state.timing_breakdown()
    state.enable_timing(log_every=2)
    net.register_comm_hook(state, pst.powerSGD_hook)
    buckets = set()
    records = []

    class Capture(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Capture(level=logging.INFO)
    logger = logging.getLogger("powersgd.torch")
    logger.addHandler(handler)
    previous_level = logger.level
    logger.setLevel(logging.INFO)
    steps = 9
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    backward_seconds = []
    try:
        for _ in range(steps):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(net(x), y)
            start = time.monotonic()
            loss.backward()
            backward_seconds.append(time.monotonic() - start)
            optimizer.step()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous_level)
    buckets = len(net._get_ddp_logging_data().get("rebuilt_bucket_sizes", "").split(","))
    assert buckets >= 3, "only %d DDP buckets" % buckets
    compressed = steps - pst.DECLARATION_ITER
    b = state.timing_breakdown()
    assert b["steps"] == compressed, (b["steps"], compressed)
    assert set(b) == set(_timing.FIELDS) | {"steps"}, sorted(b)
    for name in _timing.FIELDS:
        if name != "engine_other":
            assert b[name] >= 0.0, (name, b)
    parts = sum(b[name] for name in _timing.TAIL_PARTS)
    assert abs(b["tail"] - parts) < 1e-6, ("tail is not the sum of its parts", b)
    kinds = sum(b[name] for name in _timing.ENGINE_KINDS)
    # The kinds are timed inside the reductions' runs on the worker (clock reads of 1 us or better).
    assert kinds <= b["engine_busy"] + 1e-4 and abs(b["engine_other"] - (b["engine_busy"] - kinds)) < 1e-9, b
    assert b["communicate"] > 0.0 and b["compress"] > 0.0 and b["engine_busy"] > 0.0, b
    assert 0.0 < b["ctypes_submit"] <= b["hook"], b
    assert b["copies"] == 0.0, ("float32 buckets are read in place", b)
    # Rounds (issue 28): a compressed reduction, alone or a fused group, pays 2 (the announce carrying P, then
    # Q) where both fit the direct bound, as this model's do, and 3 where its announce could not carry P
    # (a fused group the lookahead had not prepared, or a reduction whose proposed fusion the others did not
    # agree to): so 2 to 3 per bucket. One bucket per step: exactly 2 (below).
    rounds = [step["rounds"] for step in state._timer.steps]
    assert all(isinstance(r, int) and 2 <= r <= 3 * buckets for r in rounds), (rounds, buckets)
    assert b["rounds"] == sum(rounds) / len(rounds), (b, rounds)
    # The tail lies inside backward(): on average no longer than a compressed step's backward.
    mean_backward = sum(backward_seconds[pst.DECLARATION_ITER:]) / compressed
    assert 0.0 < b["tail"] <= mean_backward, (b["tail"], mean_backward)
    logged = [m for m in records if m.startswith("PowerSGD reduction timing")]
    assert len(logged) == compressed // 2, records
    assert "mean of the last 2 steps: tail" in logged[0] and "communicate" in logged[0], logged[0]
    assert "communication rounds (mean of 2 steps)" in logged[0], logged[0]

    # One bucket per step: one reduction, its announce carrying P, then Q: exactly 2 rounds in every step.
    state = pst.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=pst.DECLARATION_ITER)
    state.enable_timing()
    for _ in range(pst.DECLARATION_ITER + 4):
        pst.powerSGD_hook(state, FakeBucket(0, [(32, 16), (16,)], True)).wait()
    rounds = [step["rounds"] for step in state._timer.steps]
    assert rounds == [2] * 4, rounds
    state.close()

    # A step that fails at its last bucket (a changed layout) after its first was submitted: its futures fail,
    # it is not recorded, and the earlier steps' record stays.
    state = pst.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=pst.DECLARATION_ITER)
    state.enable_timing()
    shapes = [[(16, 8)], [(8, 4), (4,)]]
    for step in range(pst.DECLARATION_ITER + 3):
        changed = step == pst.DECLARATION_ITER + 2
        futures = [pst.powerSGD_hook(state, FakeBucket(i, [(4, 8)] if changed and i == 1 else shapes[i], i == 1))
                   for i in range(2)]
        if changed:
            futures[0].wait()
            expect_failure("a changed layout at the last bucket", futures[1].wait, ["changed", "bucket 1"])
        else:
            for future in futures:
                future.wait()
    assert state.timing_breakdown()["steps"] == 2, state.timing_breakdown()
    state.close()

    if rank() == 0:
        # A bad PSGD_TORCH_TIMING: the import fails, naming the variable and what it expects.
        environment = dict(os.environ, PSGD_TORCH_TIMING="often")
        run = subprocess.run([sys.executable, "-c", "import powersgd.torch"], env=environment,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode != 0 and "PSGD_TORCH_TIMING='often'" in run.stderr \
            and "integer >= 0" in run.stderr, run.stderr
        print("timing: %d DDP buckets, %s" % (buckets, _timing.format_breakdown(b)))


# ---- checkpoints (run by checkpoint_resume.py: save on 3 ranks, killed; resume on 3, then on 2) ----
CKPT_STEP, CKPT_TOTAL = 6, 11
CKPT_OPTIONS = dict(matrix_approximation_rank=1, start_powerSGD_iter=4, use_error_feedback=True, warm_start=True)


def ckpt_model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))


def ckpt_ddp(module, **options):
    # Small buckets: DDP's first iteration has one bucket, its rebuilt layout two (read at construction).
    dist._DEFAULT_FIRST_BUCKET_BYTES = 4096
    return ddp(module, bucket_cap_mb=0.004, **options)


def ckpt_data():
    # The same batches for a step in every run: seeded by the rank of the saving job (3 ranks).
    return data(4, CKPT_TOTAL, seed=5)


def train_steps(model, optimizer, inputs, targets, first, last):
    """Steps first to last - 1 of the batches; returns their losses (this rank's batch)."""
    losses = []
    for step in range(first, last):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs[step]), targets[step])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def ckpt_train(model, optimizer, state, first, last):
    losses = train_steps(model, optimizer, *ckpt_data(), first, last)
    assert state.iter == last, (state.iter, last)
    return losses


def ckpt_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def error_memories(state):
    """This rank's error memory of every declared bucket (the engine's, psgd_reducer_error_feedback_n)."""
    lib, memories = pst._capi.lib, []
    for index in range(len(state._declared)):
        size = ctypes.c_size_t()
        pst._capi.check(lib.psgd_reducer_bucket_size(state._reducer, index, ctypes.byref(size)))
        memory = torch.empty(size.value)
        pst._capi.check(lib.psgd_reducer_error_feedback_n(state._reducer, index, ctypes.c_void_p(memory.data_ptr()),
                                                          size.value))
        memories.append(memory)
    return memories


def case_checkpoint_save(directory):
    """3 ranks: the uninterrupted run (its parameters saved), then the run that saves at CKPT_STEP with
    torch.save (model, optimizer, pickled PowerSGDState) and is killed (SIGKILL, no cleanup)."""
    import os
    import signal
    assert world() == 3
    module = ckpt_model()
    model = ckpt_ddp(module)
    state = pst.PowerSGDState(None, **CKPT_OPTIONS)
    model.register_comm_hook(state, pst.powerSGD_hook)
    ckpt_train(model, ckpt_optimizer(model), state, 0, CKPT_TOTAL)
    torch.save(module.state_dict(), "%s/reference-rank%d.pt" % (directory, rank()))
    state.close()

    module = ckpt_model()
    model = ckpt_ddp(module)
    optimizer = ckpt_optimizer(model)
    state = pst.PowerSGDState(None, **CKPT_OPTIONS)
    model.register_comm_hook(state, pst.powerSGD_hook)
    ckpt_train(model, optimizer, state, 0, CKPT_STEP)
    assert state.compression_stats()[1] > 0, "nothing compressed before the checkpoint"
    torch.save(error_memories(state), "%s/memory-rank%d.pt" % (directory, rank()))
    torch.save({"model": module.state_dict(), "optimizer": optimizer.state_dict(), "powersgd": state},
               "%s/ckpt-rank%d.pt" % (directory, rank()))
    job = state.job_state_dict()  # collective: the ranks' mean error memory; rank 0 saves it
    if rank() == 0:
        torch.save({"model": module.state_dict(), "optimizer": optimizer.state_dict(), "powersgd": job},
                   "%s/ckpt-job.pt" % directory)
    torch.save(state.compression_stats(), "%s/stats-rank%d.pt" % (directory, rank()))
    dist.barrier()
    if rank() == 0:
        print("checkpoint-save: saved at iteration %d, killing every rank" % state.iter, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def ckpt_resume(path, register=True):
    """A fresh model, DDP and optimizer from the checkpoint at `path`; the unpickled PowerSGDState (or one
    loaded from the job_state_dict() saved there) as hook."""
    saved = torch.load(path)
    module = ckpt_model()
    module.load_state_dict(saved["model"])
    model = ckpt_ddp(module)
    optimizer = ckpt_optimizer(model)
    optimizer.load_state_dict(saved["optimizer"])
    state = saved["powersgd"]
    if isinstance(state, dict):
        state, sd = pst.PowerSGDState(None, **CKPT_OPTIONS), state
        state.load_state_dict(sd)
    assert isinstance(state, pst.PowerSGDState) and state.iter == CKPT_STEP, state.iter
    if register:
        model.register_comm_hook(state, pst.powerSGD_hook)
    return module, model, optimizer, state


def case_checkpoint_resume(directory):
    """3 ranks: each resumes its own file and ends bitwise where the uninterrupted run ended; a fresh state
    with only iter restored (as PyTorch's __setstate__ does) trains on. 2 ranks: both resume rank 0's file
    through the job checkpoint (mean error memory, step count); see docs/torch.md, "Checkpoints"."""
    if world() == 3:
        module, model, optimizer, state = ckpt_resume("%s/ckpt-rank%d.pt" % (directory, rank()))
        ckpt_train(model, optimizer, state, CKPT_STEP, CKPT_TOTAL)
        assert state._resumed_from == "rank", state._resumed_from
        reference = torch.load("%s/reference-rank%d.pt" % (directory, rank()))
        for name, value in module.state_dict().items():
            if not torch.equal(value, reference[name]):
                raise AssertionError("checkpoint-resume: %s differs from the uninterrupted run by %g" %
                                     (name, (value - reference[name]).abs().max().item()))
        state.close()
        # iter alone (torch's __setstate__ restores it into a fresh state): the layout check still holds.
        module, model, optimizer, _ = ckpt_resume("%s/ckpt-rank%d.pt" % (directory, rank()), register=False)
        fresh = pst.PowerSGDState(None, **CKPT_OPTIONS)
        fresh.iter = CKPT_STEP
        model.register_comm_hook(fresh, pst.powerSGD_hook)
        losses = ckpt_train(model, optimizer, fresh, CKPT_STEP, CKPT_TOTAL)
        assert fresh.compression_stats()[1] > 0 and all(map(math.isfinite, losses)), losses
        fresh.close()
        if rank() == 0:
            print("checkpoint-resume/3: parameters bitwise equal to the uninterrupted run's after %d resumed "
                  "steps; iter alone restored: %d steps trained" % (CKPT_TOTAL - CKPT_STEP, CKPT_TOTAL - CKPT_STEP))
        return
    assert world() == 2
    module, model, optimizer, state = ckpt_resume("%s/ckpt-job.pt" % directory)
    saved_stats = torch.load("%s/stats-rank0.pt" % directory)
    losses = ckpt_train(model, optimizer, state, CKPT_STEP, CKPT_TOTAL)
    assert state._resumed_from == "job", state._resumed_from
    # The engine's counters went on from the checkpoint's: every resumed step compressed the same elements
    # as each of the saved run's compressed steps (CKPT_STEP - start_powerSGD_iter of them).
    per_step = saved_stats[1] // (CKPT_STEP - CKPT_OPTIONS["start_powerSGD_iter"])
    assert state.compression_stats()[1] == saved_stats[1] + (CKPT_TOTAL - CKPT_STEP) * per_step, (
        state.compression_stats(), saved_stats)
    assert all(map(math.isfinite, losses)), losses
    gathered = [torch.zeros_like(p) for p in module.parameters() for _ in range(2)]
    for i, p in enumerate(module.parameters()):
        dist.all_gather(gathered[2 * i:2 * i + 2], p.detach())
        assert torch.equal(gathered[2 * i], gathered[2 * i + 1]), "parameters differ between the ranks"
    # The error memory the job checkpoint gives every rank: the mean of the 3 saving ranks' own.
    state.load_state_dict(torch.load("%s/ckpt-job.pt" % directory)["powersgd"])
    assert state._resumed_from == "job", state._resumed_from
    saved = [torch.load("%s/memory-rank%d.pt" % (directory, r)) for r in range(3)]
    for index, memory in enumerate(error_memories(state)):
        mean = sum(s[index].double() for s in saved) / 3
        difference = (memory.double() - mean).abs().max().item()
        assert difference <= 1e-6, (index, difference)
        assert mean.abs().max().item() > 1e-3, "the saved error memory is zero: nothing compared"
    # Rank 0's own pickled state on both ranks: its warm start and step count, error memory zero.
    state.load_state_dict(torch.load("%s/ckpt-rank0.pt" % directory)["powersgd"].state_dict())
    assert state._resumed_from == "shared", state._resumed_from
    assert all(memory.abs().max().item() == 0 for memory in error_memories(state))
    # Refused loads change nothing: the attributes (iter, the config) were assigned before the engine refused,
    # or before a missing key was found; a dict from before the first compressed iteration left the running
    # engine's state in place. Every rank refuses alike.
    from powersgd import _checkpoint
    train_steps(model, optimizer, *ckpt_data(), CKPT_STEP, CKPT_STEP + 2)  # error memory that is not zero
    before = ({name: getattr(state, name) for name in _checkpoint.CONFIG_FIELDS}, state.iter,
              [memory.clone() for memory in error_memories(state)])
    corrupted = state.state_dict()
    corrupted["iter"] = 3
    data = bytearray(corrupted["engine"]["rank_data"])
    data[-1] ^= 0xFF  # the engine refuses it (CRC) on every rank: its own data on each
    corrupted["engine"]["rank_data"] = bytes(data)
    no_iter = state.state_dict()
    del no_iter["iter"]
    untrained = pst.PowerSGDState(None, **CKPT_OPTIONS).state_dict()
    for what, bad, error, words in [("corrupted engine data", corrupted, pst.PowerSGDError, "is corrupted: CRC-32"),
                                    ("no iter", no_iter, ValueError, "lacks or mangles 'iter'"),
                                    ("before compression", untrained, pst.PowerSGDError, "holds no engine state")]:
        try:
            state.load_state_dict(bad)
        except error as e:
            assert words in str(e), (what, e)
        else:
            raise AssertionError("load_state_dict(%s) accepted" % what)
        after = ({name: getattr(state, name) for name in _checkpoint.CONFIG_FIELDS}, state.iter,
                 error_memories(state))
        assert after[:2] == before[:2], (what, after[:2], before[:2])
        assert all(torch.equal(a, b) for a, b in zip(after[2], before[2])), what
    # A local failure on one rank before a job checkpoint's collectives (a full temporary directory): every rank
    # fails at once, none waiting for the one that raised (before, they waited for the group's timeout, and the
    # raising rank's next collective paired with their save_job); the group goes on.
    job = torch.load("%s/ckpt-job.pt" % directory)["powersgd"]
    for what, name in [("job_state_dict", "_temporary_dir"), ("load_state_dict of a job checkpoint", "_write")]:
        real = getattr(_checkpoint, name)
        if rank() == 1:
            def full(*_):
                raise OSError(28, "No space left on device")
            setattr(_checkpoint, name, full)
        start = time.monotonic()
        try:
            state.job_state_dict() if name == "_temporary_dir" else state.load_state_dict(job)
        except (OSError, pst.PowerSGDError) as e:
            if name == "_temporary_dir":
                assert (rank() == 1) == isinstance(e, OSError), (what, e)
            else:  # a refusal agreed before the load: PowerSGDError on every rank, the full disk named on rank 1
                assert isinstance(e, pst.PowerSGDError), (what, e)
                assert ("No space left" if rank() == 1 else "refused on rank(s) [1]") in str(e), (what, e)
        else:
            raise AssertionError("%s with a full disk on rank 1 returned" % what)
        finally:
            setattr(_checkpoint, name, real)
        assert time.monotonic() - start < 10, (what, time.monotonic() - start)
    assert state.iter == before[1], state.iter
    state.job_state_dict()
    # A dict whose configuration says otherwise than its engine data (another matrix rank): the running
    # engine's configuration stays, and so do the attributes that made it (they took the dict's before).
    other = state.state_dict()
    other["config"]["matrix_approximation_rank"] += 1
    state.load_state_dict(other)
    assert state.matrix_approximation_rank == other["config"]["matrix_approximation_rank"] - 1
    if rank() == 0:
        print("checkpoint-resume/2: %d steps on 2 ranks from the 3 ranks' job checkpoint; error memory = the saved "
              "ranks' mean; compression counters continued; rank 0's own file: error memory zero"
              % (CKPT_TOTAL - CKPT_STEP))


def case_lr_watch():
    torch.manual_seed(1)
    model = ddp(TwoLayers())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=6, gamma=0.1)
    state = pst.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=3,
                              rank_high=3, lr_boost_steps=2, lr_watch=optimizer)
    model.register_comm_hook(state, pst.powerSGD_hook)
    inputs, targets = data(4, 16, seed=3)
    log = []
    for x, y in zip(inputs, targets):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        scheduler.step()  # decays after iterations 6 and 12: noted at the first bucket of iterations 6 and 12
        log += state.decisions()
    assert state.lr_notes == 2, state.lr_notes
    buckets = sorted({d["bucket"] for d in log})
    for b in buckets:
        mine = [(d["step"], d["rank"], d["reason"]) for d in log if d["bucket"] == b]
        boosts = [entry for entry in mine if entry[2] == "lr_note"]
        assert [(step, r) for step, r, _ in boosts] == [(3, 3), (9, 3)], mine  # engine steps: iteration - 3
        assert (5, 1, "fixed") in mine and (11, 1, "fixed") in mine, mine
    everyone = [None] * world()
    dist.all_gather_object(everyone, log)
    assert all(other == log for other in everyone), everyone
    for bad in ({"warmup_steps": -1}, {"lr_boost_steps": 1.5}):
        try:
            pst.PowerSGDState(process_group=None, **bad)
        except (TypeError, ValueError) as e:
            assert list(bad)[0] in str(e), e
        else:
            raise AssertionError("PowerSGDState accepted %s" % bad)
    try:
        pst.PowerSGDState(process_group=None, lr_watch=object())
    except TypeError as e:
        assert "lr_watch" in str(e), e
    else:
        raise AssertionError("PowerSGDState accepted lr_watch=object()")
    state.close()
    if rank() == 0:
        print("lr-watch: two StepLR decays, two boosts per bucket, equal on every rank: %s" % log)


class Branchy(nn.Module):
    """A trunk and a head, and a branch added to the head's output from `branch_from` on: unused before (DDP
    with find_unused_parameters), or used but scaled by 0.0 (a zero gradient without DDP's unused logic)."""

    def __init__(self, scaled):
        super().__init__()
        self.trunk = nn.Linear(16, 32, bias=False)
        self.head = nn.Linear(32, 8, bias=False)
        self.branch = nn.Linear(32, 8, bias=False)
        self.scaled = scaled
        self.use_branch = False

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        if self.scaled:
            return self.head(h) + (1.0 if self.use_branch else 0.0) * self.branch(h)
        return self.head(h) + self.branch(h) if self.use_branch else self.head(h)


def case_unused_branch():
    steps, branch_from = 12, 6
    for scaled in (False, True):
        for error_feedback in (True, False):
            name = "unused-branch/%s/error_feedback=%s" % ("scaled by 0.0" if scaled else "find_unused_parameters",
                                                          error_feedback)
            ddp_options = {} if scaled else dict(find_unused_parameters=True)
            torch.manual_seed(1)
            reference = Branchy(scaled)
            ours = copy.deepcopy(reference)
            plain = ddp(reference, **ddp_options)
            net = ddp(ours, **ddp_options)
            # Compressed from iteration 2: steps 2 to 5 reduce a zero branch gradient.
            state = pst.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                      use_error_feedback=error_feedback)
            net.register_comm_hook(state, pst.powerSGD_hook)
            inputs, targets = data(8, steps, seed=12)
            norms = []
            for model, module in ((plain, reference), (net, ours)):
                optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
                norms.append([])
                for step, (x, y) in enumerate(zip(inputs, targets)):
                    module.use_branch = step >= branch_from
                    optimizer.zero_grad()
                    nn.functional.mse_loss(model(x), y).backward()
                    grad = module.branch.weight.grad
                    norms[-1].append(0.0 if grad is None else grad.norm().item())
                    optimizer.step()
            assert state.compression_stats()[1] > 0, "%s: nothing was compressed" % name
            plain_norms, our_norms = norms
            if rank() == 0:
                print("%s: |branch grad| from step %d, allreduce %s, powersgd rank 1 %s"
                      % (name, branch_from, " ".join("%.4f" % n for n in plain_norms[branch_from:]),
                         " ".join("%.4f" % n for n in our_norms[branch_from:])))
            assert all(n == 0.0 for n in our_norms[:branch_from]), (name, our_norms)
            # Rank 1 carries a step's top singular direction (error feedback the rest later): comparable,
            # not equal.
            for step in range(branch_from, steps):
                assert our_norms[step] > 0.2 * plain_norms[step], (name, step, plain_norms, our_norms)
            assert sum(our_norms[branch_from:]) > 0.4 * sum(plain_norms[branch_from:]), (name, plain_norms, our_norms)
            state.close()


class Sandwich(nn.Module):
    """`first`, another DDP model, then `last`. The inner model is kept outside the module tree (DDP of this
    model leaves its parameters alone). Backward computes `last`'s gradients (DDP's first bucket: 1 MiB, it
    holds `last` alone), then the inner model's (its hook runs, and waits for its reductions, while this
    model's first bucket is in flight), then `first`'s (this model's last bucket)."""

    def __init__(self, inner):
        super().__init__()
        self.first = nn.Linear(16, 64, bias=False)
        self.last = nn.Linear(512, 512)
        self.inner = (inner,)

    def forward(self, x):
        return self.last(torch.relu(self.inner[0](torch.relu(self.first(x)))))


def case_two_models():
    steps = 10
    torch.manual_seed(7)
    inner_reference = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 512))
    outer_reference = Sandwich(None)
    inner_ours, outer_ours = copy.deepcopy(inner_reference), copy.deepcopy(outer_reference)
    generator = torch.Generator().manual_seed(70 + rank())
    inputs = [torch.randn(1, 16, generator=generator) for _ in range(steps)]
    targets = [torch.randn(1, 512, generator=generator) for _ in range(steps)]

    def run(inner, outer, hooked):
        inner_ddp = ddp(inner)
        outer.inner = (inner_ddp,)
        outer_ddp = ddp(outer)
        states = []
        if hooked:
            # One sample per rank: each weight's mean gradient has rank <= world, reproduced at that rank.
            for model in (outer_ddp, inner_ddp):
                states.append(pst.PowerSGDState(process_group=None, matrix_approximation_rank=world(),
                                                start_powerSGD_iter=3, use_error_feedback=False))
                model.register_comm_hook(states[-1], pst.powerSGD_hook)
        optimizer = torch.optim.SGD(list(outer.parameters()) + list(inner.parameters()), lr=0.05)
        for x, y in zip(inputs, targets):
            optimizer.zero_grad()
            nn.functional.mse_loss(outer_ddp(x), y).backward()
            optimizer.step()
        return states

    run(inner_reference, outer_reference, hooked=False)
    states = run(inner_ours, outer_ours, hooked=True)
    for state in states:
        rate, before, after = state.compression_stats()
        assert before > 0 and after < before, "nothing was compressed (%s)" % ((rate, before, after),)
    for name, ours, reference in (("outer", outer_ours, outer_reference), ("inner", inner_ours, inner_reference)):
        flat = torch.cat([p.detach().reshape(-1) for p in ours.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world())]
        dist.all_gather(gathered, flat)
        for other in gathered:
            assert torch.equal(other, flat), "two-models: the %s model's parameters differ between ranks" % name
        difference = check_close("two-models/" + name, ours, reference, 1e-5)
        if rank() == 0:
            print("two-models: %s model, largest parameter difference from DDP allreduce %.2g over %d steps"
                  % (name, difference, steps))


# ---- issue 30: PyTorch's checkpoint pattern, its schedule, errors in its terms, what is supported ----

def shared_directory():
    """A directory rank 0 creates, the same path on every rank (powersgd-run: one host)."""
    import tempfile
    name = [tempfile.mkdtemp(prefix="powersgd-rank0-") if rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return name[0]


def all_equal(module, what):
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world())]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(g, flat) for g in gathered), "%s: parameters differ between the ranks" % what


def case_checkpoint_rank0():
    """PyTorch's tutorial pattern: `if rank == 0: torch.save({..., "hook": state})`, then every rank loads that
    one file and continues. Saving is local (before: rank 0 waited in the job checkpoint's allgather until the
    engine's timeout, here PSGD_TIMEOUT_MS = 20 s, and failed with PSGD_ERR_TIMEOUT)."""
    import shutil
    os.environ.setdefault("PSGD_TIMEOUT_MS", "20000")
    save_at, total = 6, 10
    options = dict(matrix_approximation_rank=1, start_powerSGD_iter=3)
    inputs, targets = data(4, total, seed=9)
    module = ckpt_model()
    model = ddp(module)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = pst.PowerSGDState(None, **options)
    model.register_comm_hook(state, pst.powerSGD_hook)
    train_steps(model, optimizer, inputs, targets, 0, save_at)
    saved_stats = state.compression_stats()
    assert saved_stats[1] > 0
    directory = shared_directory()
    path = os.path.join(directory, "checkpoint.pt")
    if rank() == 0:
        records = Records()
        logging.getLogger("powersgd.torch").addHandler(records)
        started = time.monotonic()
        torch.save({"model": module.state_dict(), "optimizer": optimizer.state_dict(), "hook": state}, path)
        took = time.monotonic() - started
        logging.getLogger("powersgd.torch").removeHandler(records)
        assert took < 5, "saving on rank 0 alone took %.1f s" % took
        assert not any("serializable" in m for m in records.messages), records.messages
    dist.barrier()
    own = [m.clone() for m in error_memories(state)]
    assert max(m.abs().max().item() for m in own) > 1e-3, "the error memory is zero: nothing to check"

    # Every rank resumes from rank 0's file.
    saved = torch.load(path)
    module = ckpt_model()
    module.load_state_dict(saved["model"])
    model = ddp(module)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    optimizer.load_state_dict(saved["optimizer"])
    state = saved["hook"]
    assert isinstance(state, pst.PowerSGDState) and state.iter == save_at
    model.register_comm_hook(state, pst.powerSGD_hook)
    losses = train_steps(model, optimizer, inputs, targets, save_at, total)
    assert state._resumed_from == "shared", state._resumed_from
    assert all(map(math.isfinite, losses)), losses
    per_step = saved_stats[1] // (save_at - options["start_powerSGD_iter"])
    assert state.compression_stats()[1] == saved_stats[1] + (total - save_at) * per_step, (
        state.compression_stats(), saved_stats)
    all_equal(module, "checkpoint-rank0")
    # What the file gives every rank: rank 0's warm start and step count, error memory zero.
    state.load_state_dict(torch.load(path)["hook"].state_dict())
    assert state._resumed_from == "shared"
    assert all(m.abs().max().item() == 0 for m in error_memories(state))

    # The collective job checkpoint, explicitly: every rank calls job_state_dict(), rank 0 saves it; loaded on
    # every rank it gives the ranks' mean error memory.
    train_steps(model, optimizer, inputs, targets, 0, 2)  # two more steps: a non-zero error memory again
    memories = [m.clone() for m in error_memories(state)]
    job = state.job_state_dict()
    if rank() == 0:
        torch.save({"hook": job}, os.path.join(directory, "job.pt"))
    dist.barrier()
    state.load_state_dict(torch.load(os.path.join(directory, "job.pt"))["hook"])
    assert state._resumed_from == "job", state._resumed_from
    for memory, loaded in zip(memories, error_memories(state)):
        mean = memory.clone()
        dist.all_reduce(mean)
        mean /= world()
        assert (loaded - mean).abs().max().item() <= 1e-6
    dist.barrier()
    if rank() == 0:
        shutil.rmtree(directory)
        print("checkpoint-rank0: saved by rank 0 alone in %.3f s; %d steps resumed from it on %d ranks (error "
              "memory zero, warm start and counters continued); job_state_dict(): the mean error memory"
              % (took, total - save_at, world()))


def sched_run(options, first, last, save=None, resume=None, ddp_options=None):
    """Trains ckpt_model from `first` to `last`; `resume`: (model, optimizer, state) dicts to start from;
    `save`: the step after which to return those dicts (the run stops there)."""
    import pickle
    inputs, targets = data(4, last, seed=11)
    module = ckpt_model()
    model = ckpt_ddp(module, **(ddp_options or {}))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if resume is None:
        state = pst.PowerSGDState(None, **options)
    else:
        module.load_state_dict(resume[0])
        optimizer.load_state_dict(resume[1])
        state = pickle.loads(resume[2])
    model.register_comm_hook(state, pst.powerSGD_hook)
    stop = save if save is not None else last
    train_steps(model, optimizer, inputs, targets, first, stop)
    if save is not None:
        result = (copy.deepcopy(module.state_dict()), copy.deepcopy(optimizer.state_dict()), pickle.dumps(state))
    else:
        result = module
    decisions = state.decisions()
    stats = state.compression_stats()
    state.close()
    return result, stats, decisions


def case_schedule():
    # Compression starts at start_powerSGD_iter (2: PyTorch's earliest with error feedback), in every DDP mode.
    for ddp_options in ({}, {"static_graph": True}, {"gradient_as_bucket_view": True}):
        inputs, targets = data(4, 5, seed=12)
        module = ckpt_model()
        model = ckpt_ddp(module, **ddp_options)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        state = pst.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        model.register_comm_hook(state, pst.powerSGD_hook)
        train_steps(model, optimizer, inputs, targets, 0, 2)
        assert state.compression_stats()[1] == 0, (ddp_options, state.compression_stats())
        train_steps(model, optimizer, inputs, targets, 2, 3)
        first = state.compression_stats()[1]
        assert first > 0, ("iteration 2 not compressed", ddp_options)
        train_steps(model, optimizer, inputs, targets, 3, 5)
        assert state.compression_stats()[1] == 3 * first, (ddp_options, state.compression_stats(), first)
        all_equal(module, "schedule %s" % ddp_options)
        state.close()

    # A resume from a checkpoint taken before compression starts is the uninterrupted run, bitwise, with the
    # same compressed elements; decisions() counts DDP's iterations.
    total = 11
    for saved_at, start in ((4, 5), (1, 3), (3, 4), (3, 7)):
        options = dict(matrix_approximation_rank=1, start_powerSGD_iter=start, warmup_steps=2)
        reference, reference_stats, decisions = sched_run(options, 0, total)
        assert decisions and min(d["iteration"] for d in decisions) == start, decisions
        assert all(d["iteration"] == d["step"] + start for d in decisions), decisions
        checkpoint, _, _ = sched_run(options, 0, total, save=saved_at)
        resumed, stats, _ = sched_run(options, saved_at, total, resume=checkpoint)
        for (name, a), b in zip(resumed.named_parameters(), reference.parameters()):
            if not torch.equal(a, b):
                raise AssertionError("schedule: saved at %d, compressed from %d: %s differs from the uninterrupted "
                                     "run by %g" % (saved_at, start, name, (a - b).abs().max().item()))
        assert stats == reference_stats, (saved_at, start, stats, reference_stats)
    if rank() == 0:
        print("schedule: compressed from iteration 2 in 3 DDP modes; resumed before compression (4 cases) bitwise "
              "the uninterrupted run; decisions from iteration start_powerSGD_iter")


def case_user_terms():
    # A TypeError says what it expects once.
    for options, words in ((dict(compression_stats_logging_frequency=1.5), "expected an integer"),
                           (dict(matrix_approximation_rank=2.5), "expected an integer")):
        try:
            pst.PowerSGDState(None, **options)
        except TypeError as e:
            assert words in str(e) and str(e).count("integer") == 1, str(e)
        else:
            raise AssertionError("%s accepted" % options)
    try:
        pst.PowerSGDState(None).enable_timing(1.5)
    except TypeError as e:
        assert str(e).count("integer") == 1, str(e)

    # Arguments that differ between the ranks: named as PowerSGDState's, with each rank's value.
    for options, words in ((dict(start_powerSGD_iter=5 + 3 * rank()), "start_powerSGD_iter = 5 on rank 0, 8 on rank 1"),
                           (dict(matrix_approximation_rank=1 + rank(), start_powerSGD_iter=2),
                            "matrix_approximation_rank = 1 on rank 0, 2 on rank 1")):
        inputs, targets = data(4, 8, seed=13)
        model = ddp(TwoLayers())
        state = pst.PowerSGDState(None, **options)
        model.register_comm_hook(state, pst.powerSGD_hook)

        def steps():
            for x, y in zip(inputs, targets):
                nn.functional.mse_loss(model(x), y).backward()
        message = expect_failure("different arguments", steps, ["PSGD_ERR_MISMATCH", words])
        assert "config." not in message, message
        state.close()

    # Pickling says nothing on any rank (PyTorch's NOTE: Process group is not serializable, on every save).
    import io
    records = Records()
    logging.getLogger("powersgd.torch").addHandler(records)
    state = pst.PowerSGDState(None)
    torch.load(io.BytesIO(save_to_bytes(state)))
    logging.getLogger("powersgd.torch").removeHandler(records)
    assert not any("NOTE" in m for m in records.messages), records.messages

    # An engine failure is the exception's message only: the library prints no `powersgd[R] error:` line too.
    import tempfile
    comm = pst._engine_comm(None, datetime.timedelta(seconds=3))
    from powersgd import _capi
    _capi.check(_capi.lib.psgd_comm_barrier(comm))
    if rank() == 1:
        time.sleep(6)
    with tempfile.TemporaryFile() as capture:
        saved_fd = os.dup(2)
        os.dup2(capture.fileno(), 2)
        try:
            status = _capi.lib.psgd_comm_barrier(comm)
            message = _capi.last_error()
        finally:
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
        capture.seek(0)
        printed = capture.read().decode("utf-8", "replace")
    assert status != 0, "the barrier did not fail"
    assert "powersgd[" not in printed, "stderr repeats the error: %r (the error: %s)" % (printed, message)
    if rank() == 0:
        print("user-terms: TypeError says 'an integer' once; differing arguments named with each rank's value; "
              "pickling logs nothing; an engine error is not printed besides the exception")


def case_supported():
    """What docs/torch.md's "What is supported" says, checked: its section exists and names each claim; two
    PowerSGDStates in one process group (a GAN: generator and discriminator, separate optimizers and backward
    passes, error feedback and warm start) train, bitwise equal on every rank; a bfloat16 model is refused by
    DDP itself (torch 1.13: Gloo has no bfloat16), with the message the section quotes."""
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "..", "..", "docs", "torch.md")) as f:
        text = f.read()
    assert "\n## What is supported\n" in text, "docs/torch.md has no section 'What is supported'"
    section = text.split("\n## What is supported\n", 1)[1].split("\n## ", 1)[0]
    for words in ("several `PowerSGDState`s", "GAN", "bfloat16", "Invalid scalar type", "--redirects 1 --tee 1",
                  "start_powerSGD_iter", "rank 0"):
        assert words in section, "docs/torch.md, 'What is supported', does not mention %r" % words

    # A GAN: the discriminator's DDP runs twice per iteration (real and fake batches, then the generator's
    # step through it), each model with its own state.
    torch.manual_seed(3)
    generator_net = ddp(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16)))
    discriminator = ddp(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    states = []
    for model in (generator_net, discriminator):
        states.append(pst.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2))
        model.register_comm_hook(states[-1], pst.powerSGD_hook)
    g_optimizer = torch.optim.Adam(generator_net.parameters(), lr=1e-3)
    d_optimizer = torch.optim.Adam(discriminator.parameters(), lr=1e-3)
    noise = torch.Generator().manual_seed(30 + rank())
    bce = nn.functional.binary_cross_entropy_with_logits
    for step in range(8):
        real = torch.randn(8, 16, generator=noise) + 2
        fake = generator_net(torch.randn(8, 8, generator=noise))
        d_optimizer.zero_grad()
        d_loss = bce(discriminator(torch.cat([real, fake.detach()])), torch.cat([torch.ones(8, 1), torch.zeros(8, 1)]))
        d_loss.backward()
        d_optimizer.step()
        g_optimizer.zero_grad()
        g_loss = bce(discriminator(fake), torch.ones(8, 1))
        g_loss.backward()  # the discriminator's DDP reduces its gradients too (its state's iteration)
        g_optimizer.step()
        assert math.isfinite(d_loss.item()) and math.isfinite(g_loss.item())
    for state in states:
        assert state.compression_stats()[1] > 0, state.compression_stats()
    all_equal(generator_net.module, "GAN generator")
    all_equal(discriminator.module, "GAN discriminator")
    for state in states:
        state.close()

    # On a group of its own: the failed broadcast may fail the group's next collective too.
    scratch = dist.new_group(list(range(world())))
    try:
        ddp(nn.Linear(4, 4).bfloat16(), process_group=scratch)
    except RuntimeError as e:
        assert "Invalid scalar type" in str(e), str(e)
    else:
        if torch.__version__.startswith("1.13"):
            raise AssertionError("DDP accepted a bfloat16 model in torch 1.13: docs/torch.md says it refuses it")
    if rank() == 0:
        print("supported: the section states each claim; a GAN with two states trains (iterations %d and %d); "
              "DDP refuses a bfloat16 model" % (states[0].iter, states[1].iter))


def case_load_refusal():
    """A state_dict one rank refuses before the engine's agreement, loaded while the engine reducer runs: rank 1
    loads a bad dict, rank 0 its own. Before, rank 1 raised at once and rank 0 waited in the agreement's allreduce
    for the whole timeout (then the communicator was broken); now both raise at once and nothing changes."""
    os.environ["PSGD_TIMEOUT_MS"] = "10000"  # the engine communicator's, created at the declaration below
    torch.manual_seed(1)
    model = ddp(TwoLayers())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    options = dict(matrix_approximation_rank=1, start_powerSGD_iter=2)
    state = pst.PowerSGDState(None, **options)
    model.register_comm_hook(state, pst.powerSGD_hook)
    inputs, targets = data(4, 8, seed=7)
    train_steps(model, optimizer, inputs, targets, 0, 5)
    assert state._reducer is not None and state.iter == 5, state.iter
    own = state.state_dict()
    memory = error_memories(state)
    assert any(m.abs().max().item() > 0 for m in memory), "error memory zero: nothing to compare"
    untrained = pst.PowerSGDState(None, **options).state_dict()  # engine None: saved before the declaration
    other = copy.deepcopy(own)
    other["engine"]["declared"] = {0: [(3, 3)]}
    mangled = copy.deepcopy(own)
    del mangled["engine"]["declared_at"]
    # A job checkpoint only on rank 1, rank 0 its own data: no kind every rank can load (before: rank 0 loaded
    # the shared state, rank 1 refused after the agreement).
    job_only = copy.deepcopy(state.job_state_dict())  # collective
    job_only["engine"]["rank_data"] = None
    no_kind = "some ranks' dicts hold a job checkpoint only"
    for what, bad, words, words0 in [
            ("saved before the declaration", untrained, "holds no engine state", "refused on rank(s) [1]"),
            ("other declared buckets", other, "are not the ones this state declared", "refused on rank(s) [1]"),
            ("a mangled engine entry", mangled, "lacks 'declared_at'", "refused on rank(s) [1]"),
            ("a job checkpoint only", job_only, no_kind, no_kind)]:
        start = time.monotonic()
        try:
            state.load_state_dict(bad if rank() == 1 else own)
        except (ValueError, pst.PowerSGDError) as e:
            expected = words if rank() == 1 else words0
            assert expected in str(e), (what, str(e))
        else:
            raise AssertionError("load_state_dict (%s on rank 1) accepted on rank %d" % (what, rank()))
        waited = time.monotonic() - start
        assert waited < 5, "%s on rank 1: rank %d raised after %.1f s" % (what, rank(), waited)
        assert state.iter == 5 and state.matrix_approximation_rank == 1, (what, state.iter)
        assert all(torch.equal(a, b) for a, b in zip(error_memories(state), memory)), what
    train_steps(model, optimizer, inputs, targets, 5, 8)  # the group goes on
    assert state.iter == 8 and state._failure is None, (state.iter, state._failure)
    all_equal(model.module, "load-refusal")
    if rank() == 0:
        print("load-refusal: 4 dicts refused on rank 1 failed both ranks at once; nothing changed; trained on")


def save_to_bytes(value):
    import io
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def state_model_parameters(factory):
    torch.manual_seed(1)
    return list(factory().parameters())


def case_store_interrupt():
    """A KeyboardInterrupt in a store callback during the engine's rendezvous (Ctrl-C while it waits for
    peers): init_comm raises it once the library returned, and no exception crossed into the library (ctypes
    printed it, "Exception ignored on calling ctypes callback function", handed the library an undefined
    status, and the interrupt was lost)."""
    from powersgd import _store

    def interrupted(*args):
        raise KeyboardInterrupt()

    unraisable = []
    saved = sys.unraisablehook, _store.TorchStore._wait, _store.TorchStore._get
    sys.unraisablehook = unraisable.append
    _store.TorchStore._wait = _store.TorchStore._get = interrupted
    raised = None
    try:
        # This rank alone in a group of 3 that never fills: the rendezvous waits in the store.
        _store.init_comm(0, 3, "interrupt-%d" % rank())
    except KeyboardInterrupt as e:
        raised = e
    finally:
        sys.unraisablehook, _store.TorchStore._wait, _store.TorchStore._get = saved
    assert raised is not None, "the KeyboardInterrupt in the store callback was lost"
    assert not unraisable, "an exception crossed into the library: %r" % [u.exc_value for u in unraisable]


CASES = {
    "parity-plain": case_parity_plain,
    "parity-exact": case_parity_exact,
    "low-rank": case_low_rank,
    "many-buckets": case_many_buckets,
    "errors": case_errors,
    "timing": case_timing,
    "groups": case_groups,
    "validation": case_validation,
    "knobs": case_knobs,
    "dtype-float64": lambda: case_dtype(torch.float64, 1e-6),
    "dtype-float16": lambda: case_dtype(torch.float16, 4e-3),
    "dtype-bfloat16": case_bfloat16,
    "checkpoint-save": case_checkpoint_save,
    "checkpoint-resume": case_checkpoint_resume,
    "lr-watch": case_lr_watch,
    "unused-branch": case_unused_branch,
    "two-models": case_two_models,
    "checkpoint-rank0": case_checkpoint_rank0,
    "schedule": case_schedule,
    "user-terms": case_user_terms,
    "supported": case_supported,
    "load-refusal": case_load_refusal,
    "store-interrupt": case_store_interrupt,
}
# Cases that take a directory argument.
DIRECTORY_CASES = ("checkpoint-save", "checkpoint-resume")


def main():
    if len(sys.argv) != (3 if sys.argv[1:2] and sys.argv[1] in DIRECTORY_CASES else 2) or sys.argv[1] not in CASES:
        print("usage: ddp_hook.py {%s} [DIRECTORY]" % ",".join(CASES), file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    if os.environ.get("POWERSGD_TEST_INIT_METHOD"):  # torchrun_env.py --file-store
        dist.init_process_group("gloo", init_method=os.environ["POWERSGD_TEST_INIT_METHOD"],
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    elif os.environ.get("POWERSGD_TEST_TORCH_INIT") == "1":  # an unchanged script: torch's own env://
        dist.init_process_group("gloo")
    else:
        pst.init_process_group("gloo")
    CASES[sys.argv[1]](*sys.argv[2:])
    dist.barrier()
    if rank() == 0:
        print("%s: passed" % sys.argv[1])
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
