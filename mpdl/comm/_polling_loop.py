"""The compiled loops of `mpdl.comm.polling` (imported only when first needed: numba).

Each takes its arguments as one int64 array of addresses and counts (`polling` lays it out), so
numba compiles it once with a given signature and keeps it in its on-disk cache; the C functions
(MPI_Testall, MPI_Startall, sched_yield, memcpy) are called at addresses read from that array.
"""

from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_I32, _I64 = ir.IntType(32), ir.IntType(64)
_PTR = ir.IntType(8).as_pointer()

# where each loop finds its arguments in the block (mpdl.comm.polling fills it)
TESTALL, SCHED_YIELD, COUNT, HANDLES, FLAG, STATUSES, STARTALL, MEMCPY, DST, SRC, NBYTES = range(11)


@intrinsic
def _call_testall(typingctx, address, count, handles, flag, statuses):
    """int MPI_Testall(int, MPI_Request *, int *, MPI_Status *) called at an address."""
    signature = types.int32(types.int64, types.int64, types.int64, types.int64, types.int64)

    def codegen(context, builder, sig, args):
        function = builder.inttoptr(
            args[0], ir.FunctionType(_I32, [_I32, _PTR, _PTR, _PTR]).as_pointer())
        return builder.call(function, [builder.trunc(args[1], _I32),
                                       *(builder.inttoptr(a, _PTR) for a in args[2:])])

    return signature, codegen


@intrinsic
def _call_startall(typingctx, address, count, handles):
    """int MPI_Startall(int, MPI_Request *) called at an address."""
    signature = types.int32(types.int64, types.int64, types.int64)

    def codegen(context, builder, sig, args):
        function = builder.inttoptr(args[0], ir.FunctionType(_I32, [_I32, _PTR]).as_pointer())
        return builder.call(function, [builder.trunc(args[1], _I32),
                                       builder.inttoptr(args[2], _PTR)])

    return signature, codegen


@intrinsic
def _call_memcpy(typingctx, address, dst, src, nbytes):
    """memcpy(dst, src, nbytes) called at an address; returns nothing useful."""
    signature = types.int64(types.int64, types.int64, types.int64, types.int64)

    def codegen(context, builder, sig, args):
        function = builder.inttoptr(args[0], ir.FunctionType(_PTR, [_PTR, _PTR, _I64]).as_pointer())
        result = builder.call(function, [builder.inttoptr(args[1], _PTR),
                                         builder.inttoptr(args[2], _PTR), args[3]])
        return builder.ptrtoint(result, _I64)

    return signature, codegen


@intrinsic
def _call_void(typingctx, address):
    """int f(void) called at an address (sched_yield)."""
    signature = types.int32(types.int64)

    def codegen(context, builder, sig, args):
        function = builder.inttoptr(args[0], ir.FunctionType(_I32, []).as_pointer())
        return builder.call(function, [])

    return signature, codegen


@intrinsic
def _load_int(typingctx, address):
    """The int at an address (the flag MPI_Testall sets)."""
    signature = types.int32(types.int64)

    def codegen(context, builder, sig, args):
        return builder.load(builder.inttoptr(args[0], _I32.as_pointer()))

    return signature, codegen


@numba.njit("boolean(int64[::1], int64, int64)", cache=True, nogil=True)
def poll(block, polls, yield_every):
    """MPI_Testall on the block's requests up to `polls` times, sched_yield every `yield_every`
    polls; True once the flag is set."""
    for i in range(1, polls + 1):
        _call_testall(block[TESTALL], block[COUNT], block[HANDLES], block[FLAG], block[STATUSES])
        if _load_int(block[FLAG]):
            return True
        if i % yield_every == 0:
            _call_void(block[SCHED_YIELD])
    return False


@numba.njit("boolean(int64[::1], int64, int64)", cache=True, nogil=True)
def start_copy_poll(block, polls, yield_every):
    """MPI_Startall on the block's requests, memcpy of its NBYTES from SRC to DST while they
    travel, then `poll`."""
    _call_startall(block[STARTALL], block[COUNT], block[HANDLES])
    if block[NBYTES] > 0:
        _call_memcpy(block[MEMCPY], block[DST], block[SRC], block[NBYTES])
    return poll(block, polls, yield_every)
