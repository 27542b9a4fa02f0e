"""The compiled polling loop of `mpdl.comm.polling` (imported only when first needed: numba)."""

from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.extending import intrinsic


@intrinsic
def _call_testall(typingctx, address, count, handles, flag, statuses):
    """int MPI_Testall(int, MPI_Request *, int *, MPI_Status *) called at an address."""
    signature = types.int32(types.int64, types.int64, types.int64, types.int64, types.int64)

    def codegen(context, builder, sig, args):
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32), i8p, i8p, i8p])
        function = builder.inttoptr(args[0], fnty.as_pointer())
        return builder.call(function, [builder.trunc(args[1], ir.IntType(32)),
                                       *(builder.inttoptr(a, i8p) for a in args[2:])])

    return signature, codegen


@intrinsic
def _call_void(typingctx, address):
    """int f(void) called at an address (sched_yield)."""
    signature = types.int32(types.int64)

    def codegen(context, builder, sig, args):
        function = builder.inttoptr(args[0], ir.FunctionType(ir.IntType(32), []).as_pointer())
        return builder.call(function, [])

    return signature, codegen


@intrinsic
def _load_int(typingctx, address):
    """The int at an address (the flag MPI_Testall sets)."""
    signature = types.int32(types.int64)

    def codegen(context, builder, sig, args):
        return builder.load(builder.inttoptr(args[0], ir.IntType(32).as_pointer()))

    return signature, codegen


@numba.njit("boolean(int64[::1], int64, int64)", cache=True, nogil=True)
def poll(block, polls, yield_every):
    """MPI_Testall at block[0] on (block[2] requests, handles at block[3], flag at block[4],
    statuses at block[5]) up to `polls` times, sched_yield (at block[1]) every `yield_every`
    polls; True once the flag is set."""
    for i in range(1, polls + 1):
        _call_testall(block[0], block[2], block[3], block[4], block[5])
        if _load_int(block[4]):
            return True
        if i % yield_every == 0:
            _call_void(block[1])
    return False
