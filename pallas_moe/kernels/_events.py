"""Event counters for persistent kernels: wait, notify and fetch-and-add across CTAs.

An event is an i32 counter in GMEM that producers raise and consumers wait on until it
reaches a target (the "event tensor" of the megakernel, `docs/decode.md`). Two backends
share one interface, `Events`:

- Compiled (`interpret=False`): the counters are a Mosaic GPU global semaphore array
  (`pl.get_global(plgpu.SemaphoreType.REGULAR((N,)))`, zeroed by Pallas before every
  call), updated with inline PTX atomics:
  - notify: a warpgroup barrier (so the lane that waited on the TMA store is done),
    `fence.proxy.async.global` (the TMA store's writes, made by the async proxy, are
    ordered before generic-proxy operations), `fence.acq_rel.gpu`, then relaxed
    `red.add` from up to 128 lanes in parallel: the fence plus a relaxed RMW is a
    release. A range of counters costs one fence and ceil(count / 128) reds per lane.
  - wait: one lane polls with relaxed loads until the counter reaches the target and
    fences (`fence.acq_rel.gpu`: the relaxed read plus the fence is an acquire); after a
    warpgroup barrier every lane fences again, `fence.acq_rel.gpu` and
    `fence.proxy.async.global`, so its later generic loads and the TMA loads it issues
    (async proxy) are ordered after the acquire.
  - fetch-and-add (the dynamic scheduler's work queue): one lane's `atom.add`, broadcast to
    the warpgroup through SMEM.
- Interpret (`interpret=True`): GPU interpret mode has no semaphores or atomics. The counters
  are a kernel output `[3, N + 1]` of plain i32: row w holds the increments made by
  warpgroup w (consumer 0, consumer 1, producer), so no two simulated threads ever
  read-modify-write the same word; a counter's value is the sum of its column. Waiting is
  a bounded poll of that sum; a wait that times out is recorded in column N of the
  waiter's row instead of hanging, so a wrong target or a missing notify fails a test.
  The kernel returns the array, and tests check the final counts against the targets.
  Interpret mode runs CTAs one after another, so CTA 0 zeroes the counters before it hands
  out its first task, and only schedules whose waits are satisfiable by earlier CTAs (one
  CTA, or the dynamic queue, where CTA 0 takes every task) can be interpreted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# Rows of the interpret-mode counter array: one per warpgroup that may notify.
INTERPRET_ROWS = 3
# Polls before an interpret-mode wait gives up and records a violation (each poll is a few
# host callbacks; a correct schedule never gets near this).
INTERPRET_POLLS = 20000

_SCALAR = plgpu.Layout.WG_SPLAT(shape=())


def _ir():
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref, scf

    return mgpu, ir, arith, memref, scf


def _scalar(value):
    return value.registers.item()


def _counter_ptr(mgpu, ir, sem, index):
    i32 = ir.IntegerType.get_signless(32)
    return mgpu.utils.getelementptr(mgpu.utils.memref_ptr(sem), [index], i32)


def _compiled_notify(sem, first, count, inc) -> None:
    """counters[first + i] += inc for i < count, from all 128 lanes, with release order."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), _SCALAR, _SCALAR, _SCALAR))
    def _notify(ctx, sem, first, count, inc):
        del ctx
        mgpu, ir, arith, _, scf = _ir()
        utils = mgpu.utils
        i32 = ir.IntegerType.get_signless(32)
        index = ir.IndexType.get()
        first, count, inc = _scalar(first), _scalar(count), _scalar(inc)
        utils.warpgroup_barrier()  # the lane that waited for the TMA store is past it
        utils.inline_ptx("fence.proxy.async.global;", has_side_effects=True)
        utils.inline_ptx("fence.acq_rel.gpu;", has_side_effects=True)
        lane = arith.remui(utils.thread_idx(), utils.c(128, i32))
        loop = scf.ForOp(
            arith.index_cast(index, lane), arith.index_cast(index, count),
            arith.constant(index, 128),
        )
        with ir.InsertionPoint(loop.body):
            i = arith.index_cast(i32, loop.induction_variable)
            ptr = _counter_ptr(mgpu, ir, sem, arith.addi(first, i))
            utils.inline_ptx(
                "red.relaxed.gpu.global.add.s32 [$0], $1;", ptr, inc, has_side_effects=True
            )
            scf.YieldOp([])

    _notify(sem, first, count, inc)


def _compiled_wait(sem, index, target) -> None:
    """Blocks the warpgroup until counters[index] >= target (acquire)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), _SCALAR, _SCALAR))
    def _wait(ctx, sem, index, target):
        del ctx
        mgpu, ir, arith, _, scf = _ir()
        utils = mgpu.utils
        i32 = ir.IntegerType.get_signless(32)
        ptr = _counter_ptr(mgpu, ir, sem, _scalar(index))
        target = _scalar(target)
        with utils.single_thread(utils.ThreadSubset.WARPGROUP):
            loop = scf.WhileOp([], [])
            before = loop.before.blocks.append()
            with ir.InsertionPoint(before):
                value = utils.inline_ptx(
                    "ld.relaxed.gpu.global.s32 $0, [$1];", ptr, result_types=i32,
                    has_side_effects=True,
                )
                scf.condition(arith.cmpi(arith.CmpIPredicate.slt, value, target), [])
            after = loop.after.blocks.append()
            with ir.InsertionPoint(after):
                utils.nanosleep(utils.c(32, i32))  # back off: fewer polls of a hot line
                scf.yield_([])
            utils.inline_ptx("fence.acq_rel.gpu;", has_side_effects=True)
        utils.warpgroup_barrier()
        # Every lane (whichever one issues the TMA loads or the generic loads that follow)
        # orders its own later accesses after the acquire, in both proxies.
        utils.inline_ptx("fence.acq_rel.gpu;", has_side_effects=True)
        utils.inline_ptx("fence.proxy.async.global;", has_side_effects=True)

    _wait(sem, index, target)


def _compiled_fetch_add(sem, index, inc, smem):
    """old = counters[index]; counters[index] += inc (one atomic), old broadcast to the
    warpgroup through `smem` (an i32 [1] SMEM ref)."""

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(), _SCALAR, _SCALAR, plgpu.RefType()),
        return_type=plgpu.ShapeDtypeStruct((), jnp.int32, _SCALAR),
    )
    def _fetch_add(ctx, sem, index, inc, smem):
        del ctx
        mgpu, ir, arith, memref, _ = _ir()
        utils = mgpu.utils
        i32 = ir.IntegerType.get_signless(32)
        ptr = _counter_ptr(mgpu, ir, sem, _scalar(index))
        zero = arith.constant(ir.IndexType.get(), 0)
        utils.warpgroup_barrier()  # every lane is done reading the previous broadcast
        with utils.single_thread(utils.ThreadSubset.WARPGROUP):
            old = utils.inline_ptx(
                "atom.relaxed.gpu.global.add.s32 $0, [$1], $2;", ptr, _scalar(inc),
                result_types=i32, has_side_effects=True,
            )
            memref.store(old, smem, [zero])
        utils.warpgroup_barrier()
        return mgpu.FragmentedArray.splat(memref.load(smem, [zero]), (), is_signed=True)

    return _fetch_add(sem, index, inc, smem)


class Events:
    """The counters of one kernel invocation, seen from one warpgroup.

    Args:
      ref: compiled: the global semaphore array (N,); interpret: the i32 output [3, N + 1].
      interpret: which backend (see the module docstring).
      row: interpret mode: this warpgroup's row (0, 1: consumers, 2: producer).
      num_events: N.
      scratch: an i32 [1] SMEM ref for `fetch_add`'s broadcast (producer only).
    """

    def __init__(self, ref, *, interpret: bool, row: int, num_events: int, scratch=None):
        self.ref = ref
        self.interpret = interpret
        self.row = row
        self.num_events = num_events
        self.scratch = scratch

    # -- interpret-mode helpers --------------------------------------------------------
    def _value(self, index):
        total = self.ref[0, index]
        for r in range(1, INTERPRET_ROWS):
            total = total + self.ref[r, index]
        return total

    def zero(self) -> None:
        """Interpret mode: zero every counter (compiled counters start at zero)."""
        if not self.interpret:
            return

        def clear(i, carry):
            for r in range(INTERPRET_ROWS):
                self.ref[r, i] = jnp.int32(0)
            return carry

        jax.lax.fori_loop(0, self.num_events + 1, clear, None)

    # -- the interface -------------------------------------------------------------------
    def notify(self, index, inc=1) -> None:
        """counters[index] += inc, ordered after this warpgroup's completed writes."""
        self.notify_range(index, jnp.int32(1), inc)

    def notify_range(self, first, count, inc=1) -> None:
        """counters[first + i] += inc for i in [0, count)."""
        first = jnp.asarray(first, jnp.int32)
        count = jnp.asarray(count, jnp.int32)
        inc = jnp.asarray(inc, jnp.int32)
        if not self.interpret:
            _compiled_notify(self.ref, first, count, inc)
            return

        def add(i, carry):
            self.ref[self.row, first + i] = self.ref[self.row, first + i] + inc
            return carry

        jax.lax.fori_loop(0, count, add, None)

    def wait(self, index, target) -> None:
        """Blocks until counters[index] >= target (interpret: bounded, see module doc)."""
        index = jnp.asarray(index, jnp.int32)
        target = jnp.asarray(target, jnp.int32)
        if not self.interpret:
            _compiled_wait(self.ref, index, target)
            return

        def pending(polls):
            return (self._value(index) < target) & (polls < INTERPRET_POLLS)

        jax.lax.while_loop(pending, lambda polls: polls + 1, jnp.int32(0))

        @pl.when(self._value(index) < target)
        def _():
            col = self.num_events
            self.ref[self.row, col] = self.ref[self.row, col] + 1

    def fetch_add(self, index, inc=1):
        """Returns counters[index] and adds `inc` to it, atomically (one producer per CTA)."""
        index = jnp.asarray(index, jnp.int32)
        inc = jnp.asarray(inc, jnp.int32)
        if not self.interpret:
            return _compiled_fetch_add(self.ref, index, inc, self.scratch)
        old = self._value(index)
        self.ref[self.row, index] = self.ref[self.row, index] + inc
        return old
