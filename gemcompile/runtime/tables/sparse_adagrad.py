"""Adagrad for embedding tables that only reads and writes the rows a step looked up.

``SparseAdagrad`` is ``torch.optim.Adagrad`` (same hyperparameters, same state: ``sum`` and ``step`` per
table, so checkpoints are interchangeable with dense Adagrad's) over SparseGrad tables
(sparse_tables.py). ``step()`` takes the (ids, gradient rows) every lookup of a table filed since the last
step, and updates only those rows: on CUDA one stable sort and one Triton launch for all the tables of a
parameter group that share a dim and dtype (a table at a time took about fifteen launches each), the
plain-PyTorch reference elsewhere (lowering/sparse_embedding/). A row that was not looked up keeps its
weight and sum exactly, as under dense Adagrad, whose gradient is zero there; the looked-up rows get the
dense update: bit for bit on the CPU in fp32 for an nn.Embedding looked up once per step, within fp32
rounding otherwise (a row's gradient rows are summed in the order the ids were filed; torch's CPU bag
backward and autograd's sum over several lookups add them in other orders).

The tables may also be sparse ShardedTables of the parallel runtime (runtime/distributed/embedding.py):
their weight and Adagrad sum are DTensors (the same placements as dense Adagrad's sum, so DCP saves,
loads and reshards them alike), and the filed ids are rows of this rank's shard, which is what the
update reads and writes (``to_local()``). A replicated shard's update sums each row in a fixed order
(``identical_replicas``), so that its replicas stay identical.

What it does not do: lr_decay, weight_decay, maximize (a ValueError at construction); gradient clipping of
the table gradients (they never exist as tensors: build dense tables when you clip); accumulating
gradients over several backward passes before a step (each backward's rows are kept and summed at the
step, which is the same thing; a ``zero_grad()`` drops them). A table whose weight also gets a dense
``.grad`` (tied to an output layer, ``logits = h @ table.weight.T``, as SASRec and BERT4Rec do) gets its
filed rows added into that gradient and one dense Adagrad update, exactly what dense training does. The
tables are given at construction (``add_param_group`` refuses weights it was not built with: their lookups'
keys come from the table modules).

Host time: per parameter group the first step works out a plan (each table's pending key, local weight and
sum, its place in the batched launch, checked once) and keeps it while the optimizer state, the parameter
list, the sum tensors and the weights' addresses stay (a ``load_state_dict`` or a replaced ``.data`` makes a
new one). The plan also makes every table's ``state["step"]`` a 0-d view of one buffer (the value and dtype
dense Adagrad keeps; checkpoints store it as usual), so that a step counts with one add.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from gemcompile.lowering.sparse_embedding.adagrad import adagrad_rows_
from gemcompile.lowering.sparse_embedding.pending import clear, take_rows
from gemcompile.runtime.tables.optimizer_closure import run_closure
from gemcompile.runtime.tables.sparse_tables import is_sparse_grad_table

__all__ = ["SparseAdagrad"]


def _add_rows_(grad: torch.Tensor, filed: list) -> None:
    for ids, rows in filed:
        keep = ids >= 0
        grad.index_add_(0, ids[keep], rows[keep].to(grad.dtype))


class SparseAdagrad(torch.optim.Adagrad):
    """Adagrad over the weights of SparseGrad tables (or sparse ShardedTables), updating only the
    looked-up rows at each step."""

    def __init__(self, tables: list[nn.Module], lr: float = 1e-2, eps: float = 1e-10,
                 initial_accumulator_value: float = 0.0) -> None:
        if not tables or not all(is_sparse_grad_table(t) for t in tables):
            raise TypeError("SparseAdagrad takes a non-empty list of SparseGrad tables "
                            "(runtime/tables/sparse_tables.py: use_sparse_row_gradients) or sparse "
                            "ShardedTables (runtime/distributed/embedding.py)")
        self._keys = {id(t.weight): t.table_key for t in tables}
        self._fixed_order = {id(t.weight) for t in tables if getattr(t, "identical_replicas", False)}
        super().__init__([t.weight for t in tables], lr=lr, eps=eps,
                         initial_accumulator_value=initial_accumulator_value, foreach=False)
        self._plans: dict[int, _Plan] = {}  # per parameter group

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        if any(id(p) not in self._keys for p in params):
            raise TypeError("SparseAdagrad.add_param_group: takes only the weights of the tables it was "
                            "built with (their lookups file rows under the table module's key); build "
                            "another SparseAdagrad for other tables")
        super().add_param_group(param_group)

    # torch.amp.GradScaler hands an optimizer with this flag itself to step (grad_scaler=...): the rows filed
    # by the tables are no .grad it could unscale or check for inf, so step refuses it by name
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        if grad_scaler is not None:
            raise RuntimeError("SparseAdagrad does not take torch.amp.GradScaler: the sparse tables file their "
                               "looked-up rows' gradients, no .grad the scaler could unscale or check for inf. "
                               "Train them without loss scaling (bfloat16 autocast needs none), or with dense "
                               "tables: build_optimizers(..., sparse_embeddings=False) / --dense-tables")
        loss = run_closure(closure)
        dense_pending = False
        atomic_ok = not torch.are_deterministic_algorithms_enabled()  # the batched launch adds atomically
        for g, group in enumerate(self.param_groups):
            if group["lr_decay"] != 0 or group["weight_decay"] != 0 or group["maximize"]:
                raise ValueError("SparseAdagrad supports lr_decay = weight_decay = 0 and maximize = False "
                                 "only")
            plan = self._plan(g, group)
            parts: list[list] = [[] for _ in plan.sets]  # each TableSet's (table, ids, rows, share) this step
            updated = []  # tables updated here (dense Adagrad counts a step for every table with a gradient)
            for k, (p, key, weight, state_sum, where) in enumerate(plan.tables):
                filed = take_rows(key)
                if p.grad is not None:  # also used outside its lookups (a weight tied to an output layer)
                    # one dense update of the whole gradient, as dense Adagrad does
                    _add_rows_(_local(p.grad), filed)
                    dense_pending = True
                    continue
                if not filed:
                    continue
                updated.append(k)
                if where is not None and atomic_ok:
                    # each lookup's rows stay where they were filed: the update reads them in place (and
                    # checks them: rows on another device are an error either way)
                    into, t = parts[where[0]], where[1]
                    for f in filed:
                        into.append((t, f[0], f[1], f.share))
                    continue
                ids = torch.cat([i for i, _ in filed]) if len(filed) > 1 else filed[0][0]
                grads = torch.cat([g for _, g in filed]) if len(filed) > 1 else filed[0][1]
                adagrad_rows_(weight, state_sum, ids, grads, group["lr"], group["eps"],
                              deterministic=True if id(p) in self._fixed_order else None)
            for tables, set_parts in zip(plan.sets, parts):  # this group's CUDA tables of one dim and dtype
                if set_parts:
                    plan.launch(tables, set_parts, group["lr"], group["eps"])
            plan.count_steps(updated)
        if dense_pending:
            super().step()  # the tables with a dense .grad (their filed rows added in), and only those
        return loss

    def _plan(self, g: int, group: dict) -> _Plan:
        """Group g's _Plan, kept for the steps after while it holds (a load_state_dict brings new state and
        sum tensors: worked out again then)."""
        plan = self._plans.get(g)
        if plan is None or not plan.holds(self.state, group["params"]):
            plan = self._plans[g] = _Plan(self, group["params"])
        return plan

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for key in self._keys.values():
            clear(key)


class _Plan:
    """What SparseAdagrad.step needs of a parameter group's tables, worked out once: per table (param, pending
    key, local weight, local Adagrad sum, (TableSet index, table index in it) or None); the TableSets of its
    batchable tables (one per device, dim and dtype) and their launcher; and the tables' step counts as views
    of one buffer (state["step"] stays a 0-d tensor per table, as dense Adagrad's, for checkpoints; a step
    counts with one add where a per-table add over GEM-ref's 65 tables took 0.12 ms on a 2-core CPU)."""

    def __init__(self, opt: SparseAdagrad, params: list[Tensor]) -> None:
        self.state, self.params, self.count = opt.state, params, len(params)
        members: dict[tuple, list[int]] = {}  # batch key -> indexes into rows
        rows = []
        for p in params:
            weight, local_sum = _local(p), _local(opt.state[p]["sum"])
            if id(p) not in opt._fixed_order and _batchable(weight, local_sum):
                members.setdefault((weight.device, weight.shape[1], weight.dtype), []).append(len(rows))
            rows.append([p, opt._keys[id(p)], weight, local_sum, None])
        self.sets, self.launch = [], None
        if members:  # CUDA tables: Triton (a Linux-only dependency) is imported only for them
            from gemcompile.lowering.sparse_embedding.adagrad_triton import TableSet, adagrad_table_set_

            self.launch = adagrad_table_set_
        for index in members.values():
            for t, k in enumerate(index):
                rows[k][4] = (len(self.sets), t)
            self.sets.append(TableSet([rows[k][2] for k in index], [rows[k][3] for k in index]))
        self.tables = [tuple(r) for r in rows]
        states = [opt.state[p] for p in params]
        # on the CPU, as dense Adagrad keeps them (a checkpoint of a capturable run may bring CUDA ones)
        self.steps = torch.stack([state["step"].detach().to("cpu") for state in states])
        for k, state in enumerate(states):
            state["step"] = self.steps[k]
        self.sums = [(state, state["sum"], state["step"]) for state in states]

    def holds(self, state: dict, params: list[Tensor]) -> bool:
        """Whether this plan still describes the optimizer: same state, parameter list, sum and step tensors,
        table addresses."""
        return (state is self.state and params is self.params and len(params) == self.count
                and all(st["sum"] is s and st["step"] is n for st, s, n in self.sums)
                and not any(ts.moved() for ts in self.sets))

    def count_steps(self, updated: list[int]) -> None:
        """One more step for the tables at these indexes."""
        if len(updated) == self.count:
            self.steps.add_(1)
        elif updated:
            self.steps[updated] += 1


def _batchable(weight: Tensor, state_sum: Tensor) -> bool:
    """Whether a table's update can join one launch with others (a TableSet): CUDA, unit column strides and
    an fp32 sum (and, checked at each step, no deterministic-algorithms request: the launch's adds are
    atomic)."""
    return (weight.device.type == "cuda" and weight.dim() == 2 and weight.stride(1) == 1
            and state_sum.stride(1) == 1 and state_sum.dtype == torch.float32
            and weight.dtype in (torch.float32, torch.bfloat16, torch.float16))


def _local(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor (an alias: in-place updates write the DTensor), else the tensor."""
    return t.to_local() if isinstance(t, DTensor) else t
