"""Adagrad on the looked-up rows of a table on CUDA, with no host sync.

1. The ids (every lookup's since the last step, concatenated) are sorted; each distinct id gets a slot
   (its rank among the distinct ids: a cumulative sum of "differs from the previous sorted id").
2. The gradient rows are summed per slot in sorted order: each program sums a block of sorted positions
   with a segmented scan and adds one partial sum per slot it holds (atomically: a slot may span blocks).
   A row looked up 200k times in a step, as a 3-row action table is, gets one add per block of 128 rows
   instead of 200k contended adds (``index_add_``), and a far smaller rounding error.
3. One Triton launch updates every slot's table row: reads the row's Adagrad sum and weight once, writes
   both once.

The slot buffer has min(ids, table rows) rows, so the number of distinct ids never has to be read back
to the host. Ids < 0 (padding) and ids >= rows (cannot come from a valid lookup) are skipped, so a bad id
never touches memory outside the table. The adds of step 2 across blocks are atomic: their order, hence the
last bits of a row's summed gradient, varies run to run. Under ``torch.use_deterministic_algorithms(True)`` step 2
instead walks each id's run of sorted positions in order in the update kernel (deterministic, but serial
per row: slow for rows looked up many times).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.tuned_launch import INTERPRET
from .row_checks import check_rows, check_table
from .table_meta import TL_DTYPES, device_table

__all__ = ["TableSet", "adagrad_rows_triton_", "adagrad_table_set_", "adagrad_tables_triton_", "table_parts"]


@triton.jit
def _update_row(Weight, Sum, row, g, cols, col_ok, stride_w, stride_s, lr, eps):
    """Adagrad on one table row's columns, g its summed gradient (fp32): sum += g * g, then
    w += -lr * (g / (sqrt(sum) + eps)), the order of torch's single-tensor Adagrad."""
    r = row.to(tl.int64)
    s = tl.load(Sum + r * stride_s + cols, mask=col_ok, other=0.0) + g * g
    tl.store(Sum + r * stride_s + cols, s, mask=col_ok)
    w = tl.load(Weight + r * stride_w + cols, mask=col_ok, other=0.0).to(tl.float32)
    w = w + (-lr) * (g / (tl.sqrt(s) + eps))
    tl.store(Weight + r * stride_w + cols, w.to(Weight.dtype.element_ty), mask=col_ok)


@triton.jit
def _adagrad_slots_kernel(RowOf, Acc, Weight, Sum, n_rows, dim, stride_a, stride_w, stride_s, lr, eps,
                          BLOCK_D: tl.constexpr):
    slot = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < dim
    row = tl.load(RowOf + slot)
    if (row >= 0) & (row < n_rows):
        g = tl.load(Acc + slot.to(tl.int64) * stride_a + cols, mask=col_ok, other=0.0)
        _update_row(Weight, Sum, row, g, cols, col_ok, stride_w, stride_s, lr, eps)


@triton.jit(do_not_specialize=["n"])  # n: this step's id count (see _slot_sums_kernel)
def _adagrad_runs_kernel(SortedIds, Perm, Grads, Weight, Sum, n, n_rows, dim, stride_g, stride_w, stride_s,
                         lr, eps, BLOCK_D: tl.constexpr):
    # the deterministic variant: the first sorted position of each id sums its run in order
    j = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < dim
    row = tl.load(SortedIds + j)
    prev = tl.load(SortedIds + j - 1, mask=j > 0, other=-1)
    head = ((j == 0) | (row != prev)) & (row >= 0) & (row < n_rows)
    if head:
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        k = j
        cur = row
        while cur == row:
            src = tl.load(Perm + k).to(tl.int64)
            acc += tl.load(Grads + src * stride_g + cols, mask=col_ok, other=0.0).to(tl.float32)
            k += 1
            cur = tl.load(SortedIds + k, mask=k < n, other=-2)
        _update_row(Weight, Sum, row, acc, cols, col_ok, stride_w, stride_s, lr, eps)


def _valid_or_minus_one(ids: torch.Tensor, n_rows: int) -> torch.Tensor:
    """int64 ids with every id outside [0, n_rows) as -1: skipped, and counted as one id by the slots (many
    distinct ids past the table would otherwise need more slots than the table has rows)."""
    ids = ids.to(torch.int64)
    return torch.where((ids >= 0) & (ids < n_rows), ids, -1)


@triton.jit
def _seg_add(key_a, val_a, key_b, val_b):
    # segmented sum over sorted keys: b's running sum restarts where the key changes
    return key_b, tl.where(key_a == key_b, val_a + val_b, val_b)


# n, the step's id count, changes with the batch where ids are packed tokens: specialized on its divisibility
# by 16, the kernel would compile again inside a training step the first time a count were a multiple of 16
@triton.jit(do_not_specialize=["n", "n_parts"])
def _slot_sums_kernel(SortedIds, SlotSorted, Perm, Parts, Acc, n, n_parts, dim, stride_a,
                      G_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK_N)
    pos = pid * BLOCK_N + lanes
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    # skipped ids (-1: padding, out of range) sort first; their gradient rows are never read (half of the
    # rows at fill 0.5 are padding), and their slot's sum stays 0 (the update skips it anyway)
    pos_ok = (pos < n) & (tl.load(SortedIds + pos, mask=pos < n, other=-1) >= 0)
    col_ok = cols < dim
    slot = tl.load(SlotSorted + pos, mask=pos_ok, other=-1)
    src = tl.load(Perm + pos, mask=pos_ok, other=0).to(tl.int64)
    # the gradient rows stay where each lookup filed them (no concatenation): Parts is (3, n_parts) int64,
    # each part's address, row stride and first index in the ids' concatenated order
    part = tl.zeros([BLOCK_N], dtype=tl.int32)
    for p in range(1, n_parts):
        part += (src >= tl.load(Parts + 2 * n_parts + p)).to(tl.int32)
    base = tl.load(Parts + part, mask=pos_ok, other=0)
    row_stride = tl.load(Parts + n_parts + part, mask=pos_ok, other=0)
    first = tl.load(Parts + 2 * n_parts + part, mask=pos_ok, other=0)
    rows = base.to(tl.pointer_type(G_DTYPE)) + (src - first) * row_stride
    g = tl.load(rows[:, None] + cols[None, :], mask=pos_ok[:, None] & col_ok[None, :], other=0.0)
    g = g.to(tl.float32)
    keys = tl.broadcast_to(slot[:, None], (BLOCK_N, BLOCK_D))
    _, sums = tl.associative_scan((keys, g), 0, _seg_add)
    # the last position of each slot within the block holds the block's partial sum of that slot
    next_slot = tl.load(SlotSorted + pos + 1, mask=pos + 1 < n, other=-2)
    last = pos_ok & ((next_slot != slot) | (lanes == BLOCK_N - 1))
    # only the block's first and last slots can continue into a neighbouring block: their partial sums are
    # added atomically, every other slot lies wholly in this block and is stored once
    edge = (slot == tl.load(SlotSorted + pid * BLOCK_N)) | \
        (slot == tl.load(SlotSorted + tl.minimum(pid * BLOCK_N + BLOCK_N, n) - 1))
    acc = Acc + slot.to(tl.int64)[:, None] * stride_a + cols[None, :]
    tl.atomic_add(acc, sums, mask=(last & edge)[:, None] & col_ok[None, :])
    tl.store(acc, sums, mask=(last & ~edge)[:, None] & col_ok[None, :])


def _parts_table(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """(3, parts) int64 on the device: each gradient part's address, row stride and first row in the
    concatenated order."""
    firsts = [0]
    for g in grads[:-1]:
        firsts.append(firsts[-1] + g.shape[0])
    return _on_device([[g.data_ptr() for g in grads], [g.stride(0) for g in grads], firsts], device)


def _on_device(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """``torch.tensor(rows, dtype=int64)`` on ``device``, through pinned memory on CUDA: a pageable copy
    would wait for every kernel queued before it."""
    values = torch.tensor(rows, dtype=torch.int64)
    return values.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else values


def _sum_by_id(sorted_ids: torch.Tensor, perm: torch.Tensor, grads: list[torch.Tensor], n_ids: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 1-2 of the module docstring: (the id of each slot, -1 for an unused one; the fp32 sum of each
    slot's gradient rows; a one-element view of the last slot in use), from the ids sorted (``perm`` their
    positions in the concatenation of the parts ``grads``, one dtype, unit column strides) and ids in
    [-1, n_ids)."""
    n = sorted_ids.numel()
    new_id = torch.ones(n, dtype=torch.int64, device=sorted_ids.device)
    new_id[1:] = (sorted_ids[1:] != sorted_ids[:-1]).to(torch.int64)
    slot_sorted = new_id.cumsum_(0).sub_(1)  # slot of each sorted position
    slots = min(n, n_ids + 1)  # distinct ids: at most one per id, plus the padding id -1
    id_of = torch.full((slots,), -1, dtype=torch.int64, device=sorted_ids.device)
    id_of.scatter_(0, slot_sorted, sorted_ids)  # every position of a slot writes the same id
    dim = grads[0].shape[1]
    acc = torch.zeros((slots, dim), dtype=torch.float32, device=sorted_ids.device)
    parts = _parts_table(grads, sorted_ids.device)
    block_n, block_d = (128, min(64, triton.next_power_of_2(dim))) if not INTERPRET else (16, 16)
    _slot_sums_kernel[(triton.cdiv(n, block_n), triton.cdiv(dim, block_d))](
        sorted_ids, slot_sorted, perm, parts, acc, n, len(grads), dim, acc.stride(0),
        G_DTYPE=TL_DTYPES[grads[0].dtype], BLOCK_N=block_n, BLOCK_D=block_d, num_warps=4)
    return id_of, acc, slot_sorted[n - 1:]


def _float_rows(grads: torch.Tensor) -> torch.Tensor:
    """Gradient rows the slot sums read: unit column stride, a dtype the kernel loads (else fp32)."""
    if grads.dtype not in TL_DTYPES:
        grads = grads.float()
    return grads if grads.stride(-1) == 1 else grads.contiguous()


def _block(dim: int) -> int:
    return min(128 if not INTERPRET else 32, triton.next_power_of_2(dim))


@torch.no_grad()
def adagrad_rows_triton_(weight: torch.Tensor, state_sum: torch.Tensor, ids: torch.Tensor, grads: torch.Tensor,
                         lr: float, eps: float, deterministic: bool | None = None) -> None:
    """In place on `weight` and `state_sum` (rows x dim, unit column stride, fp32 sum): ids (n,) int, their
    gradient rows (n, dim); ids < 0 are ignored. `deterministic` None follows
    torch.are_deterministic_algorithms_enabled()."""
    n = ids.numel()
    if n == 0:
        return
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    n_rows, dim = weight.shape
    ids = _valid_or_minus_one(ids, n_rows)
    grads = _float_rows(grads)
    block = _block(dim)
    warps = 1 if block <= 64 else 2
    sorted_ids, perm = torch.sort(ids, stable=True)
    if deterministic:
        _adagrad_runs_kernel[(n, triton.cdiv(dim, block))](
            sorted_ids, perm, grads, weight, state_sum, n, n_rows, dim, grads.stride(0), weight.stride(0),
            state_sum.stride(0), float(lr), float(eps), BLOCK_D=block, num_warps=warps)
        return
    row_of, acc, _ = _sum_by_id(sorted_ids, perm, [grads], n_rows)
    slots = row_of.numel()
    _adagrad_slots_kernel[(slots, triton.cdiv(dim, block))](
        row_of, acc, weight, state_sum, n_rows, dim, acc.stride(0), weight.stride(0), state_sum.stride(0),
        float(lr), float(eps), BLOCK_D=block, num_warps=warps)


# -- many tables in one go ---------------------------------------------------------------------------------


# LastSlot is a one-element view at the step's id count: its address alignment changes with that count, and
# specialized on it the kernel compiled again inside a training step (seen in GEM-ref medium's first step)
@triton.jit(do_not_specialize=["LastSlot"])
def _adagrad_table_slots_kernel(KeyOf, LastSlot, Acc, WeightPtrs, SumPtrs, Rows, StrideW, StrideS,
                                rows_per_table, dim, stride_a, lr, eps, W_DTYPE: tl.constexpr,
                                BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # a slot's key is table * rows_per_table + row; the table's weight and sum are read from pointer arrays.
    # The programs stride over the slots in use (their count read here, never on the host), BLOCK_S at a
    # time: a grid over every possible slot (one per id) launched mostly empty programs
    in_use = tl.load(LastSlot) + 1
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < dim
    for first in range(tl.program_id(0) * BLOCK_S, in_use, tl.num_programs(0) * BLOCK_S):
        slot = first + tl.arange(0, BLOCK_S)
        key = tl.load(KeyOf + slot, mask=slot < in_use, other=-1)
        table = tl.where(key >= 0, key // rows_per_table, 0)
        row = tl.where(key >= 0, key % rows_per_table, 0).to(tl.int64)
        ok = (key >= 0) & (row < tl.load(Rows + table))
        mask = ok[:, None] & col_ok[None, :]
        weight_rows = tl.load(WeightPtrs + table).to(tl.pointer_type(W_DTYPE))
        weight_rows += row * tl.load(StrideW + table)
        state_rows = tl.load(SumPtrs + table).to(tl.pointer_type(tl.float32))
        state_rows += row * tl.load(StrideS + table)
        weight = weight_rows[:, None] + cols[None, :]
        state = state_rows[:, None] + cols[None, :]
        g = tl.load(Acc + slot.to(tl.int64)[:, None] * stride_a + cols[None, :], mask=mask, other=0.0)
        # sum += g * g, then w += -lr * (g / (sqrt(sum) + eps)): the order of torch's single-tensor Adagrad
        s = tl.load(state, mask=mask, other=0.0) + g * g
        tl.store(state, s, mask=mask)
        w = tl.load(weight, mask=mask, other=0.0).to(tl.float32)
        w = w + (-lr) * (g / (tl.sqrt(s) + eps))
        tl.store(weight, w.to(W_DTYPE), mask=mask)


def _update_programs(slots: int, block_s: int, device: torch.device) -> int:
    """Programs of the striding update: enough to fill the GPU a few times over, never more than the slots."""
    if INTERPRET or device.type != "cuda":
        return max(1, min(triton.cdiv(slots, block_s), 4))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(slots, block_s), 8 * sms))


class TableSet:
    """The tables one batched update serves (one dim, weight dtype and device; unit column strides; fp32
    Adagrad sums), checked once, with the (5, tables) int64 device tensor its kernel reads: each table's
    weight and sum address, rows, weight and sum row strides. SparseAdagrad keeps one per parameter group
    and kind of table across steps (the per-table work of a step is then only its parts)."""

    def __init__(self, weights: list[torch.Tensor], state_sums: list[torch.Tensor]) -> None:
        if not weights:
            raise ValueError("adagrad_tables_triton_: no tables")
        for w, s in zip(weights, state_sums, strict=True):
            check_table(w, s)
        dim, device, dtype = weights[0].shape[1], weights[0].device, weights[0].dtype
        if any(w.shape[1] != dim or w.device != device or w.dtype != dtype for w in weights):
            raise ValueError("adagrad_tables_triton_: the tables must share one dim, dtype and device")
        if dtype not in TL_DTYPES or any(w.stride(1) != 1 or s.stride(1) != 1 or s.dtype != torch.float32
                                         for w, s in zip(weights, state_sums)):
            raise ValueError(f"adagrad_tables_triton_: needs {list(TL_DTYPES)} weights and float32 sums with "
                             f"unit column strides")
        self.weights, self.state_sums = list(weights), list(state_sums)
        self.dim, self.device, self.dtype = dim, device, dtype
        self.rows_per_table = max(1, max(w.shape[0] for w in weights))
        self.addresses = tuple(w.data_ptr() for w in weights)
        self.meta = device_table((self.addresses, tuple(s.data_ptr() for s in state_sums),
                                  tuple(w.shape[0] for w in weights), tuple(w.stride(0) for w in weights),
                                  tuple(s.stride(0) for s in state_sums)), device)

    def moved(self) -> bool:
        """Whether a table's weight is now elsewhere in memory than this set's device tensor says (its
        ``.data`` replaced; the optimizer's sums change only through load_state_dict, which brings new
        tensors): build a new set then."""
        return tuple(w.data_ptr() for w in self.weights) != self.addresses


@torch.no_grad()
def adagrad_tables_triton_(weights: list[torch.Tensor], state_sums: list[torch.Tensor], ids: list,
                           grads: list, lr: float, eps: float, shares: list | None = None) -> None:
    """adagrad_rows_triton_ on several tables at once (one dim, one weight dtype, one device, unit column
    strides, fp32 sums): one sort, one gradient sum and one update launch for all of them, where a table at a
    time takes about fifteen launches each. ``ids[t]`` / ``grads[t]``: a table's ids (n,) and gradient rows
    (n, dim), or lists of such parts (one per lookup: read where they are, never concatenated).
    ``shares[t]``: for each of table t's parts, its pending.Filed share or None (a tensor's: one share or
    None); consecutive shares of one filing are read as one part. Ids < 0 or past their table are skipped.
    Not deterministic (the gradient adds are atomic); use adagrad_rows_triton_(deterministic=True) per table
    for that."""
    if not weights:
        return
    tables = TableSet(weights, state_sums)
    parts = [(t, i, g, share) for t, (ids_t, grads_t) in enumerate(zip(ids, grads, strict=True))
             for i, g, share in table_parts(ids_t, grads_t, shares[t] if shares is not None else None)]
    adagrad_table_set_(tables, parts, lr, eps)


@torch.no_grad()
def adagrad_table_set_(tables: TableSet, parts: list[tuple], lr: float, eps: float) -> None:
    """adagrad_tables_triton_ on a TableSet: ``parts`` lists (table index in the set, ids (n,), gradient rows
    (n, dim), share or None) per lookup, in any order; each is checked (a filing's shares once, through the
    filing)."""
    id_runs, grad_runs, counts, table_of_part = _runs(tables, parts)
    if not counts:
        return
    device, dim = tables.device, tables.dim
    grad_runs = [_float_rows(g) for g in grad_runs]
    if len({g.dtype for g in grad_runs}) > 1:
        grad_runs = [g.float() for g in grad_runs]
    meta, rows_per_table = tables.meta, tables.rows_per_table
    # every part's ids in one tensor and a key per id (table * rows_per_table + row, -1 to skip), built in a
    # fixed handful of launches whatever the number of tables
    flat = _joined(id_runs).to(torch.int64)
    table_of = _table_index(counts, table_of_part, device)
    inside = (flat >= 0) & (flat < meta[2].index_select(0, table_of))
    key = torch.where(inside, flat + table_of * rows_per_table, -1)
    sorted_keys, perm = torch.sort(key, stable=True)
    key_of, acc, last_slot = _sum_by_id(sorted_keys, perm, _adjacent_merged(grad_runs),
                                        len(tables.weights) * rows_per_table)
    block = _block(dim)
    block_s = 8 if not INTERPRET else 4
    _adagrad_table_slots_kernel[(_update_programs(key_of.numel(), block_s, device), triton.cdiv(dim, block))](
        key_of, last_slot, acc, meta[0], meta[1], meta[2], meta[3], meta[4], rows_per_table, dim,
        acc.stride(0), float(lr), float(eps),
        W_DTYPE=TL_DTYPES[tables.dtype], BLOCK_S=block_s, BLOCK_D=block, num_warps=4)


def table_parts(ids, grads, shares=None) -> list[tuple]:
    """A table's (ids, gradient rows, share or None) per lookup, from ``ids`` / ``grads`` given as one
    tensor pair or as lists of parts, and ``shares`` as adagrad_tables_triton_ takes them (or None)."""
    if isinstance(ids, (list, tuple)):
        return list(zip(ids, grads, shares if shares is not None else [None] * len(ids), strict=True))
    return [(ids, grads, shares)]


def _runs(tables: TableSet, parts: list[tuple]) -> tuple[list, list, list[int], list[int]]:
    """The parts checked and read as runs: every stretch of consecutive shares of one filing (pending.Filed)
    as one view of that filing's tensors, found without testing addresses. Returns (ids runs, gradient-row
    runs, ids per part, table per part), empty parts left out; the runs hold the parts' rows in order."""
    id_runs, grad_runs, counts, table_of_part = [], [], [], []
    checked = None  # the ids of the filing whose shares were checked last (a filing's shares come in a row)
    k = 0
    while k < len(parts):
        t, ids, rows, share = parts[k]
        end = k + 1
        if share is None:
            check_rows(tables.weights[t], ids, rows)
            if ids.numel():
                id_runs.append(ids)
                grad_runs.append(rows)
                counts.append(ids.numel())
                table_of_part.append(t)
            k = end
            continue
        ids_all, rows_all, first = share
        if ids_all is not checked:
            check_rows(tables.weights[t], ids_all.reshape(-1), rows_all.reshape(-1, rows_all.shape[-1]))
            checked = ids_all
        while end < len(parts) and (nxt := parts[end][3]) is not None and nxt[0] is ids_all \
                and nxt[2] == first + end - k:
            end += 1
        n = ids_all.shape[1]
        if n:
            if end - k > 1:  # the stretch as one view of the filing's tensors
                ids, rows = ids_all[first:end - k + first].reshape(-1), rows_all[first:end - k + first]
                rows = rows.reshape(-1, rows_all.shape[-1])
            id_runs.append(ids)
            grad_runs.append(rows)
            counts.extend([n] * (end - k))
            table_of_part.extend(parts[j][0] for j in range(k, end))
        k = end
    return id_runs, grad_runs, counts, table_of_part


def _adjacent_merged(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The parts with every run of consecutive slices of one buffer (the bag tables' rows, filed as views of
    one fresh tensor) as one view of that buffer: fewer parts to search, nothing copied."""
    runs, start = [], 0
    for k in range(1, len(parts) + 1):
        if k == len(parts) or not _follows(parts[k - 1], parts[k]):
            runs.append(_view_of_run(parts[start:k]))
            start = k
    return runs


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether b starts where a ends in one contiguous buffer, with a's row shape and dtype."""
    return (b.data_ptr() == a.data_ptr() + a.numel() * a.element_size() and a.dtype == b.dtype
            and a.shape[1:] == b.shape[1:] and a.is_contiguous() and b.is_contiguous()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def _view_of_run(run: list[torch.Tensor]) -> torch.Tensor:
    """One view spanning consecutive slices of a contiguous buffer (checked by _follows)."""
    first = run[0]
    if len(run) == 1:
        return first
    shape = first.shape[1:]
    inner = [1]  # contiguous strides (a one-row part's own stride need not say)
    for size in reversed(shape):
        inner.insert(0, inner[0] * size)
    return first.as_strided((sum(p.shape[0] for p in run), *shape), inner, first.storage_offset())


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts) along dim 0, copying only what is not already one buffer in order: the bag tables'
    rows, filed as consecutive views of one fresh tensor, are read in place."""
    runs = _adjacent_merged(parts)
    return runs[0] if len(runs) == 1 else torch.cat(runs)


_TABLE_INDEX: dict[tuple, torch.Tensor] = {}


def _table_index(counts: list[int], tables: list[int], device: torch.device) -> torch.Tensor:
    """The table of each id when the parts' ids (counts[p] each, of table tables[p]) are concatenated, built
    on the device, and kept for counts seen before (the bag tables' are the same every step)."""
    key = (tuple(counts), tuple(tables), device)
    index = _TABLE_INDEX.get(key)
    if index is None:
        values = _on_device([tables, counts], device)
        index = torch.repeat_interleave(values[0], values[1], output_size=sum(counts))
        if len(_TABLE_INDEX) >= 16:  # packed item ids change their count every step
            _TABLE_INDEX.clear()
        _TABLE_INDEX[key] = index
    return index
