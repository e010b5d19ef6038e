"""A reference ring all-reduce written with torch.distributed's point-to-point operations, for teaching and testing.

Training uses the library collectives (NCCL's and gloo's all-reduce are tuned, topology-aware and faster); this
module shows, in a few dozen lines, the algorithm that sets their bandwidth bound, and `scripts/comm_bench.py`
times it beside them. docs/collectives.md walks through it with a picture and the cost model.

The ring (Patarasuk and Yuan, 2009; what Baidu's allreduce and Horovod popularised for deep learning):
the n ranks of a group stand in a circle, each sends only to its right neighbour and receives only from its left
one, and the tensor is cut into n chunks.
  1. Reduce-scatter, n - 1 steps: in step s, rank r sends chunk (r - s) mod n and adds the chunk (r - s - 1) mod n
     that arrives from the left into its own copy. A chunk travels once around the circle picking up every rank's
     contribution, so after n - 1 steps rank r holds chunk (r + 1) mod n fully reduced.
  2. All-gather, n - 1 steps: in step s, rank r sends chunk (r + 1 - s) mod n (first the one it finished) and
     overwrites chunk (r - s) mod n with what arrives. Each finished chunk travels around the circle once more.
Every rank sends 2 (n - 1) chunks of S / n bytes: 2 (n - 1) / n * S bytes, whatever n is, which is the least any
all-reduce can send per rank (docs/collectives.md says why).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp
# How a received chunk is folded into the local one, in place. AVG is a SUM divided by n once at the end of the
# reduce-scatter phase (see below); every op here is elementwise, which is what lets the ring cut the tensor into
# independent chunks at all.
_COMBINE = {
    ReduceOp.SUM: lambda mine, theirs: mine.add_(theirs),
    ReduceOp.AVG: lambda mine, theirs: mine.add_(theirs),
    ReduceOp.PRODUCT: lambda mine, theirs: mine.mul_(theirs),
    ReduceOp.MIN: lambda mine, theirs: torch.minimum(mine, theirs, out=mine),
    ReduceOp.MAX: lambda mine, theirs: torch.maximum(mine, theirs, out=mine),
}


def ring_all_reduce(
    tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = ReduceOp.SUM, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Reduce `tensor` over the ranks of `group` (the default group when None) with a ring, IN PLACE, as
    `dist.all_reduce` does; returns `tensor` itself for convenience.

    `op` is SUM, AVG (floating-point tensors only), PRODUCT, MIN or MAX. Any dtype and device whose tensors the
    backend can send point-to-point works (gloo: every dtype its all_reduce takes, and int16 too; NCCL: CUDA
    tensors); any shape, including empty and fewer elements than ranks. The tensor must be contiguous: the ring
    works on a flat view of its memory. Partial sums are kept in the tensor's own dtype, as NCCL does, so a
    bfloat16 ring rounds after each of its n - 1 additions.

    Every rank of `group` must call it with the same shape and dtype, as with any collective; ranks outside the
    group must not call it.
    """
    n, rank, peers = _check(tensor, op, group)
    if n == 1 or tensor.numel() == 0:
        return tensor  # nothing to exchange (and AVG over one rank is the identity)
    flat = tensor.detach().view(-1)  # detach: a tensor that requires grad may still be reduced in place
    # n chunks whose sizes differ by at most one element (tensor_split's rule: the first numel % n chunks get the
    # extra one); with fewer elements than ranks some chunks are empty. Every rank computes the same split, so
    # sender and receiver always agree on a chunk's size without exchanging it. The chunks are views: writing
    # into them writes into `tensor`.
    chunks = torch.tensor_split(flat, n)
    right, left = peers[(rank + 1) % n], peers[(rank - 1) % n]
    combine = _COMBINE[op]

    # Phase 1, reduce-scatter. The chunk arriving in step s is the one the left neighbour combined in step s - 1,
    # so it already holds s + 1 ranks' contributions; we add ours. The incoming chunk lands in scratch memory
    # (not in place): we still need our own copy of that chunk to add it.
    scratch = torch.empty_like(chunks[0])  # chunk 0 is never smaller than any other
    for step in range(n - 1):
        send_index, recv_index = (rank - step) % n, (rank - step - 1) % n
        incoming = scratch[: chunks[recv_index].numel()]
        _exchange(chunks[send_index], right, incoming, left, group)
        combine(chunks[recv_index], incoming)
    # Rank r now holds chunk (r + 1) mod n reduced over every rank. For AVG each rank divides just that chunk:
    # 1/n of the division work per rank, and the all-gather then spreads the averaged values.
    finished = (rank + 1) % n
    if op == ReduceOp.AVG:
        chunks[finished].div_(n)

    # Phase 2, all-gather. Pass the finished chunks around the ring; what arrives is final, so it goes straight
    # into place. The chunk sent (r + 1 - s) and the one received (r - s) differ, so no buffer is read while it is
    # written.
    for step in range(n - 1):
        send_index, recv_index = (rank + 1 - step) % n, (rank - step) % n
        _exchange(chunks[send_index], right, chunks[recv_index], left, group)
    return tensor


def _exchange(
    send: torch.Tensor, to: int, recv: torch.Tensor, source: int, group: dist.ProcessGroup | None
) -> None:
    """Send `send` to global rank `to` while receiving `recv` from global rank `source`, and wait for both.

    Why both at once: with blocking `dist.send` then `dist.recv`, every rank would first send to its right
    neighbour, nobody would be receiving yet, and once sends block (NCCL always, other transports for large
    messages) the whole ring waits forever. Posting the send and the receive together (batch_isend_irecv; with
    NCCL one grouped launch) lets every transfer of the step proceed at once. Messages between two ranks arrive
    in the order they were posted, so consecutive steps cannot mix up their chunks.
    """
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, send, to, group), dist.P2POp(dist.irecv, recv, source, group)]
    )
    for work in works:
        work.wait()


def _check(
    tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None
) -> tuple[int, int, list[int]]:
    """(group size, this rank's index in the group, every group rank's global rank), or a one-line error."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"ring_all_reduce needs a torch.Tensor, not {type(tensor).__name__}")
    if op not in _COMBINE:
        raise ValueError(f"ring_all_reduce supports ReduceOp SUM, AVG, PRODUCT, MIN and MAX, not {op}")
    if op == ReduceOp.AVG and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"ring_all_reduce with AVG needs a floating-point tensor, not {tensor.dtype} (use SUM)")
    if not tensor.is_contiguous():
        raise ValueError(
            f"ring_all_reduce needs a contiguous tensor (shape {tuple(tensor.shape)}, strides {tensor.stride()}): "
            "reduce t.contiguous() and copy the result back"
        )
    if not dist.is_initialized():
        raise RuntimeError("ring_all_reduce needs a process group: call torch.distributed.init_process_group first")
    rank = dist.get_rank(group)
    if rank < 0:  # get_rank answers -1 on a rank outside `group`
        raise ValueError(f"ring_all_reduce called on global rank {dist.get_rank()}, which is not in the group")
    n = dist.get_world_size(group)
    # Point-to-point ops name their peer by global rank: map the group's ranks 0..n-1 to the world's.
    world = group if group is not None else dist.group.WORLD
    return n, rank, [dist.get_global_rank(world, i) for i in range(n)]
