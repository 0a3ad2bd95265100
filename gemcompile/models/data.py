"""Synthetic GEM-like training data: jagged user histories, multi-hot sparse features, CTR/CVR labels.

Plain PyTorch (no gemcompile import). One `SyntheticData.batch(step)` call draws a whole batch from a
`torch.Generator` seeded from (cfg.seed, step), so any step can be regenerated on its own (a run resumed
at step 21 sees the same data as an uninterrupted one).

What is drawn:
- sequence lengths: "uniform" (Meta's benchmark convention) or "heavy_tail" (log-normal, solved so that
  mean length / N = fill, with some users that have no history of a type at all);
- item ids: Zipf(1.1) ranks mapped through a seeded random permutation (FBGEMM convention), action types
  skewed (impression >> click >> conversion), event ages from log-normal gaps (oldest event first);
- multi-hot sparse ids (Zipf, clipped-normal pooling factors), dense floats N(0, 1), a domain per sample;
- labels from a hidden "teacher": a fixed random function of the features, calibrated once so that the
  mean CTR and CVR match the targets. A model can learn it, so training loss goes down.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "DataConfig",
    "GemBatch",
    "SyntheticData",
    "SHUFFLE_WINDOW",
    "SHUFFLE_SUB_BATCH",
    "lognormal_mean_fill",
    "solve_lognormal_mu",
]

LENGTH_DISTS = ("uniform", "heavy_tail")

ZIPF_ALPHA = 1.1
"""Exponent of the Zipf distribution of item and sparse ids."""

HEAVY_TAIL_SIGMA = 1.0
"""Log-normal sigma of heavy-tailed sequence lengths."""

USER_ACTIVITY_CORR = 0.7
"""Correlation of the log-lengths of one user's sequence types (shared user-activity factor)."""

NO_HISTORY_PROB = 0.05
"""heavy_tail: probability that a user has no event of a type at all (capped at (1 - fill) / 2)."""

SHUFFLE_WINDOW = 8
"""batch_shuffle: number of consecutive steps whose samples are rebalanced together."""

SHUFFLE_SUB_BATCH = 128
"""batch_shuffle: reader sub-batch size (Meta's Base Batch Shuffling uses 128)."""

LABEL_WINDOW_CLOSED_PROB = 0.9
"""Fraction of samples whose conversion window has closed (CVR label defined)."""

_CALIBRATION_TOKENS = 1 << 21  # calibration draw: 16384 samples for short sequences, fewer for long ones
_CALIBRATION_SAMPLES = (4096, 16384)
_CALIBRATION_CHUNK = 4096
_TEACHER_SCALE = 1.5  # logit = bias + domain_bias + scale * standardized signal
_TEACHER_SPARSE_BUCKETS = 1 << 16  # teacher weights per table are hashed into this many buckets
_GAP_LOG_MEAN = math.log(1800.0)  # median gap between events: 30 minutes
_GAP_LOG_STD = 2.0  # seconds .. days
_GAP_MAX = 30 * 86400.0

# Streams of randomness, mixed into the seed so they never overlap.
_STREAM_BATCH, _STREAM_TABLES, _STREAM_TEACHER, _STREAM_CALIBRATION = 1, 2, 3, 4

_MASK64 = (1 << 64) - 1

_CALIBRATION_CACHE: dict[DataConfig, tuple[Tensor, Tensor, Tensor]] = {}


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mixed_seed(*parts: int) -> int:
    """A 63-bit seed that depends on every part; the same parts give the same seed in any process."""
    h = 0
    for part in parts:
        h = _splitmix64(h ^ (part & _MASK64))
    return h >> 1


def _generator(*parts: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(_mixed_seed(*parts))


# ----------------------------------------------------------------------------------------------------
# Config and batch
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Shape and distribution of the synthetic data (keyword-only)."""

    batch_size: int
    """Samples per batch (>= 1)."""

    seq_max_lens: tuple[int, ...]
    """Padded length N_k of each sequence type (each >= 1)."""

    fill: float = 0.5
    """Target mean length / N_k, in (0, 1]. 1.0 means every sequence is full."""

    length_dist: Literal["uniform", "heavy_tail"] = "uniform"
    """"uniform": fill s >= 0.5 -> U[(2s-1)N, N], s < 0.5 -> U[0, 2sN] (Meta's benchmarks);
    "heavy_tail": log-normal(sigma 1) clipped to [0, N], mean solved to match fill."""

    item_vocab: int
    """Rows of the item table; item ids are 1..item_vocab-1 (0 = padding)."""

    n_actions: int
    """Number of action types (0 = impression, 1 = click, 2 = conversion, ...: each ~10x rarer)."""

    n_sparse_tables: int
    """Number of multi-hot sparse (non-sequence) features."""

    table_rows: int
    """Rows of every sparse table; ids are 1..table_rows-1 (0 = padding slot)."""

    max_hot: int
    """Maximum ids per sample per sparse feature (the padded width of sparse_ids)."""

    n_dense: int
    """Number of dense float features."""

    n_domains: int
    """Number of domains (e.g. FB, IG, MSG); each sample belongs to one."""

    n_tasks: int = 2
    """Label columns: 1 (CTR) or 2 (CTR, CVR)."""

    seed: int = 0
    """Seeds the tables, the teacher and every batch."""

    ctr_target: float = 0.02
    """Mean click rate the teacher is calibrated to, in (0, 1)."""

    cvr_target: float = 0.005
    """Mean conversion rate (conversions only follow clicks), in (0, ctr_target)."""

    batch_shuffle: bool = False
    """Base Batch Shuffling: rebalance total sequence length across SHUFFLE_WINDOW consecutive batches."""

    def __post_init__(self) -> None:
        def positive_int(name: str, minimum: int = 1) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"DataConfig.{name} must be an int >= {minimum}, got {value!r}")

        positive_int("batch_size")
        lens = self.seq_max_lens
        if isinstance(lens, int) or not hasattr(lens, "__iter__"):
            raise ValueError(f"DataConfig.seq_max_lens must be a tuple of ints >= 1, got {lens!r}")
        lens = tuple(lens)
        if not lens or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lens):
            raise ValueError(
                f"DataConfig.seq_max_lens must be a non-empty tuple of ints >= 1, got {self.seq_max_lens!r}"
            )
        object.__setattr__(self, "seq_max_lens", lens)
        if not isinstance(self.fill, (int, float)) or not 0.0 < self.fill <= 1.0:
            raise ValueError(f"DataConfig.fill must be in (0, 1], got {self.fill!r}")
        if self.length_dist not in LENGTH_DISTS:
            raise ValueError(
                f"DataConfig.length_dist must be one of {LENGTH_DISTS}, got {self.length_dist!r}"
            )
        positive_int("item_vocab", 2)
        positive_int("n_actions")
        positive_int("n_sparse_tables")
        positive_int("table_rows", 2)
        positive_int("max_hot")
        positive_int("n_dense")
        positive_int("n_domains")
        if self.n_tasks not in (1, 2):
            raise ValueError(f"DataConfig.n_tasks must be 1 (CTR) or 2 (CTR, CVR), got {self.n_tasks!r}")
        positive_int("seed", 0)
        if not isinstance(self.ctr_target, (int, float)) or not 0.0 < self.ctr_target < 1.0:
            raise ValueError(f"DataConfig.ctr_target must be in (0, 1), got {self.ctr_target!r}")
        if not isinstance(self.cvr_target, (int, float)) or not 0.0 < self.cvr_target < self.ctr_target:
            raise ValueError(
                f"DataConfig.cvr_target must be in (0, ctr_target={self.ctr_target}) because conversions "
                f"only follow clicks, got {self.cvr_target!r}"
            )
        if not isinstance(self.batch_shuffle, bool):
            raise ValueError(f"DataConfig.batch_shuffle must be a bool, got {self.batch_shuffle!r}")

    @property
    def n_seq(self) -> int:
        return len(self.seq_max_lens)


@dataclass
class GemBatch:
    """One batch in the padded layout (every tensor on one device)."""

    sparse_ids: Tensor
    """int64 (B, n_sparse_tables, max_hot); 0 = padding slot."""
    dense: Tensor
    """float32 (B, n_dense)."""
    seq_items: list[Tensor]
    """int64 (B, N_k) per sequence type; 0 at padded positions."""
    seq_actions: list[Tensor]
    """int64 (B, N_k) per sequence type; 0 at padded positions."""
    seq_times: list[Tensor]
    """float32 (B, N_k): age in seconds relative to the request, oldest first; 0 at padded positions."""
    seq_lengths: list[Tensor]
    """int64 (B,) per sequence type: valid length, 0 <= len <= N_k."""
    domain: Tensor
    """int64 (B,)."""
    labels: Tensor
    """float32 (B, n_tasks): 1.0 = click (task 0) / conversion (task 1)."""
    label_mask: Tensor
    """bool (B, n_tasks): False where the label is undefined (CVR window still open)."""

    @property
    def batch_size(self) -> int:
        return self.dense.shape[0]

    def features(self) -> dict[str, object]:
        """The model's keyword inputs: GemRef(**batch.features())."""
        return {
            "sparse_ids": self.sparse_ids,
            "dense": self.dense,
            "seq_items": self.seq_items,
            "seq_actions": self.seq_actions,
            "seq_times": self.seq_times,
            "seq_lengths": self.seq_lengths,
            "domain": self.domain,
        }

    def to(self, device: torch.device | str) -> GemBatch:
        def move(value):
            if isinstance(value, list):
                return [t.to(device) for t in value]
            return value.to(device)

        return GemBatch(**{f.name: move(getattr(self, f.name)) for f in fields(self)})

    def jagged(self, k: int) -> tuple[dict[str, Tensor], Tensor]:
        """Sequence k as jagged values ({"items", "actions", "times"}, each (T_k,)) and offsets (B+1,)."""
        if not 0 <= k < len(self.seq_lengths):
            raise ValueError(f"k must be in [0, {len(self.seq_lengths) - 1}], got {k}")
        lengths = self.seq_lengths[k]
        n = self.seq_items[k].shape[1]
        valid = torch.arange(n, device=lengths.device)[None, :] < lengths[:, None]
        values = {
            "items": self.seq_items[k][valid],
            "actions": self.seq_actions[k][valid],
            "times": self.seq_times[k][valid],
        }
        offsets = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64, device=lengths.device)
        offsets[1:] = torch.cumsum(lengths, 0)
        return values, offsets

    def padding_efficiency(self) -> float:
        """Valid tokens / padded tokens over all sequence types."""
        valid = sum(int(length.sum()) for length in self.seq_lengths)
        padded = self.batch_size * sum(items.shape[1] for items in self.seq_items)
        return valid / padded

    def total_lengths(self) -> Tensor:
        """int64 (B,): each sample's total valid sequence length over all types."""
        return torch.stack(self.seq_lengths, 0).sum(0)

    def select(self, index: Tensor) -> GemBatch:
        """The samples at `index` (int64 (M,)), in that order."""
        def take(value):
            if isinstance(value, list):
                return [t[index] for t in value]
            return value[index]

        return GemBatch(**{f.name: take(getattr(self, f.name)) for f in fields(self)})

    @staticmethod
    def concat(batches: list[GemBatch]) -> GemBatch:
        def cat(name):
            first = getattr(batches[0], name)
            if isinstance(first, list):
                return [torch.cat([getattr(b, name)[k] for b in batches]) for k in range(len(first))]
            return torch.cat([getattr(b, name) for b in batches])

        return GemBatch(**{f.name: cat(f.name) for f in fields(GemBatch)})


# ----------------------------------------------------------------------------------------------------
# Distributions
# ----------------------------------------------------------------------------------------------------


def lognormal_mean_fill(mu: float, sigma: float, n_max: int) -> float:
    """E[clip(round(N * X), 0, N)] / N for X ~ LogNormal(mu, sigma), exactly.

    round(N X) >= j  <=>  X >= (j - 1/2) / N, so E[clipped] = sum_{j=1..N} P(X >= (j - 1/2) / N).
    """
    j = torch.arange(1, n_max + 1, dtype=torch.float64)
    tail = torch.special.ndtr((mu - torch.log((j - 0.5) / n_max)) / sigma)
    return float(tail.sum()) / n_max


def solve_lognormal_mu(fill: float, sigma: float, n_max: int) -> float:
    """mu such that lognormal_mean_fill(mu, sigma, n_max) == fill (bisection; fill in (0, 1))."""
    lo, hi = -40.0, 40.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if lognormal_mean_fill(mid, sigma, n_max) < fill:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


class _ZipfRanks:
    """Samples ranks 0..n-1 with P(r) proportional to (r + 1)^-alpha, by inverse CDF."""

    def __init__(self, n: int, alpha: float = ZIPF_ALPHA) -> None:
        weights = torch.arange(1, n + 1, dtype=torch.float64).pow(-alpha)
        self.probs = weights / weights.sum()
        cdf = torch.cumsum(self.probs, 0)
        self.cdf = cdf / cdf[-1]
        self.n = n

    def sample(self, count: int, gen: torch.Generator) -> Tensor:
        u = torch.rand(count, generator=gen, dtype=torch.float64)
        return torch.searchsorted(self.cdf, u, right=True).clamp_(max=self.n - 1)


def _action_probs(n_actions: int) -> Tensor:
    """impression >> click >> conversion: each action type 10x rarer than the previous one."""
    weights = torch.tensor([0.1**a for a in range(n_actions)], dtype=torch.float64)
    return weights / weights.sum()


def _domain_probs(n_domains: int) -> Tensor:
    weights = torch.tensor([1.0 / (d + 1) for d in range(n_domains)], dtype=torch.float64)
    return weights / weights.sum()


def _categorical(probs: Tensor, count: int, gen: torch.Generator) -> Tensor:
    cdf = torch.cumsum(probs, 0)
    u = torch.rand(count, generator=gen, dtype=torch.float64) * cdf[-1]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=probs.numel() - 1)


# ----------------------------------------------------------------------------------------------------
# Generator
# ----------------------------------------------------------------------------------------------------


class SyntheticData:
    """Deterministic synthetic batches: `batch(step)` depends only on (cfg, step); CPU tensors."""

    def __init__(self, cfg: DataConfig) -> None:
        if not isinstance(cfg, DataConfig):
            raise TypeError(f"cfg must be a DataConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        gen = _generator(cfg.seed, _STREAM_TABLES)
        # Id popularity: Zipf ranks mapped through seeded permutations (FBGEMM convention).
        self._item_ranks = _ZipfRanks(cfg.item_vocab - 1)
        self._item_of_rank = torch.randperm(cfg.item_vocab - 1, generator=gen) + 1
        self._row_ranks = _ZipfRanks(cfg.table_rows - 1)
        # One permutation of rows shared by all tables, rotated per table (memory stays O(rows)).
        self._row_of_rank = torch.randperm(cfg.table_rows - 1, generator=gen) + 1
        self._table_rotation = torch.randint(0, cfg.table_rows - 1, (cfg.n_sparse_tables,), generator=gen)
        self._action_probs = _action_probs(cfg.n_actions)
        self._domain_probs = _domain_probs(cfg.n_domains)
        if cfg.length_dist == "heavy_tail" and cfg.fill < 1.0:
            self._no_history_prob = min(NO_HISTORY_PROB, (1.0 - cfg.fill) / 2.0)
            target = cfg.fill / (1.0 - self._no_history_prob)
            self._lognormal_mu = [solve_lognormal_mu(target, HEAVY_TAIL_SIGMA, n) for n in cfg.seq_max_lens]
        self._teacher = _Teacher(cfg, self)
        self._shuffled_window: tuple[int, list[GemBatch]] | None = None

    # -- public -------------------------------------------------------------------------------------

    def batch(self, step: int) -> GemBatch:
        """The batch of `step` (>= 0): bit-identical for the same (cfg, step) in any process."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if not self.cfg.batch_shuffle:
            return self._raw_batch(step)
        window = step // SHUFFLE_WINDOW
        if self._shuffled_window is None or self._shuffled_window[0] != window:
            self._shuffled_window = (window, self._shuffle_window(window))
        return self._shuffled_window[1][step % SHUFFLE_WINDOW]

    # -- drawing ------------------------------------------------------------------------------------

    def _raw_batch(self, step: int) -> GemBatch:
        gen = _generator(self.cfg.seed, _STREAM_BATCH, step)
        features = self._draw_features(self.cfg.batch_size, gen)
        labels, label_mask = self._teacher.draw_labels(features, gen)
        return GemBatch(**features, labels=labels, label_mask=label_mask)

    def _draw_features(self, batch_size: int, gen: torch.Generator) -> dict[str, object]:
        cfg = self.cfg
        lengths = self._draw_lengths(batch_size, gen)
        sparse_ids = self._draw_sparse(batch_size, gen)
        dense = torch.randn(batch_size, cfg.n_dense, generator=gen)
        items, actions, times = [], [], []
        for n_max, length in zip(cfg.seq_max_lens, lengths):
            valid = torch.arange(n_max)[None, :] < length[:, None]
            n_valid = int(length.sum())
            # Draw only the valid events (the jagged values), then scatter into the padded layout.
            item = torch.zeros(batch_size, n_max, dtype=torch.int64)
            item[valid] = self._item_of_rank[self._item_ranks.sample(n_valid, gen)]
            action = torch.zeros(batch_size, n_max, dtype=torch.int64)
            action[valid] = _categorical(self._action_probs, n_valid, gen)
            gaps = torch.zeros(batch_size, n_max, dtype=torch.float64)
            log_gap = _GAP_LOG_MEAN + _GAP_LOG_STD * torch.randn(n_valid, generator=gen, dtype=torch.float64)
            gaps[valid] = log_gap.exp().clamp_(1.0, _GAP_MAX)
            # Age of event i = sum of the gaps from i to the request (oldest first, ages decrease).
            age = gaps.flip(1).cumsum(1).flip(1)
            items.append(item)
            actions.append(action)
            times.append(age.to(torch.float32))
        domain = _categorical(self._domain_probs, batch_size, gen)
        return {
            "sparse_ids": sparse_ids,
            "dense": dense,
            "seq_items": items,
            "seq_actions": actions,
            "seq_times": times,
            "seq_lengths": lengths,
            "domain": domain,
        }

    def _draw_lengths(self, batch_size: int, gen: torch.Generator) -> list[Tensor]:
        cfg = self.cfg
        s = cfg.fill
        lengths = []
        if cfg.length_dist == "uniform" or s == 1.0:
            for n_max in cfg.seq_max_lens:
                lo, hi = (round((2 * s - 1) * n_max), n_max) if s >= 0.5 else (0, round(2 * s * n_max))
                lengths.append(torch.randint(lo, hi + 1, (batch_size,), generator=gen))
            return lengths
        # heavy_tail: log-normal per type, correlated through a shared per-user activity factor
        # (each type's log-length is still N(mu_k, sigma^2) marginally).
        user = torch.randn(batch_size, generator=gen, dtype=torch.float64)
        rho = USER_ACTIVITY_CORR
        for n_max, mu in zip(cfg.seq_max_lens, self._lognormal_mu):
            own = torch.randn(batch_size, generator=gen, dtype=torch.float64)
            z = rho * user + math.sqrt(1 - rho * rho) * own
            length = torch.round(n_max * torch.exp(mu + HEAVY_TAIL_SIGMA * z)).clamp_(0, n_max).long()
            no_history = torch.rand(batch_size, generator=gen) < self._no_history_prob
            lengths.append(length.masked_fill_(no_history, 0))
        return lengths

    def _draw_sparse(self, batch_size: int, gen: torch.Generator) -> Tensor:
        cfg = self.cfg
        t, h = cfg.n_sparse_tables, cfg.max_hot
        # Pooling factor ~ Normal(h / 2, h / 4) rounded and clipped to [1, max_hot] (FBGEMM style).
        pooling = torch.round(h / 2 + (h / 4) * torch.randn(batch_size, t, generator=gen)).clamp_(1, h)
        ranks = self._row_ranks.sample(batch_size * t * h, gen).view(batch_size, t, h)
        rotated = (ranks + self._table_rotation[None, :, None]) % (cfg.table_rows - 1)
        ids = self._row_of_rank[rotated]
        used = torch.arange(h)[None, None, :] < pooling[:, :, None]
        return ids * used

    # -- Base Batch Shuffling -----------------------------------------------------------------------

    def _shuffle_window(self, window: int) -> list[GemBatch]:
        """Rebalances the SHUFFLE_WINDOW raw batches of `window` (Meta's Base Batch Shuffling).

        The window's samples are cut into reader sub-batches of SHUFFLE_SUB_BATCH = 128 samples (smaller
        for batches under 8 x 128, so that every batch still mixes about 8 sub-batches), the sub-batches
        are sorted by total sequence length, and dealt heaviest first, each to the lightest batch that
        still has room: heavy sub-batches end up next to light ones and the batch totals even out. The
        multiset of the window's samples is unchanged; only their grouping into steps moves.
        """
        raw = GemBatch.concat([self._raw_batch(window * SHUFFLE_WINDOW + i) for i in range(SHUFFLE_WINDOW)])
        b = self.cfg.batch_size
        unit = _sub_batch_size(b)
        per_batch = b // unit
        unit_totals = raw.total_lengths().view(-1, unit).sum(1)
        order = torch.sort(unit_totals, descending=True, stable=True).indices.tolist()
        assigned: list[list[int]] = [[] for _ in range(SHUFFLE_WINDOW)]
        load = [0] * SHUFFLE_WINDOW
        for u in order:
            open_batches = [i for i in range(SHUFFLE_WINDOW) if len(assigned[i]) < per_batch]
            target = min(open_batches, key=lambda i: load[i])
            assigned[target].append(u)
            load[target] += int(unit_totals[u])
        batches = []
        for units in assigned:
            index = torch.cat([torch.arange(u * unit, (u + 1) * unit) for u in sorted(units)])
            batches.append(raw.select(index))
        return batches


def _sub_batch_size(batch_size: int) -> int:
    """Largest divisor of batch_size that is <= min(SHUFFLE_SUB_BATCH, batch_size // 8) (at least 1)."""
    for unit in range(min(SHUFFLE_SUB_BATCH, batch_size // 8), 1, -1):
        if batch_size % unit == 0:
            return unit
    return 1


# ----------------------------------------------------------------------------------------------------
# Teacher
# ----------------------------------------------------------------------------------------------------


class _Teacher:
    """A fixed random function of the features that produces CTR/CVR probabilities.

    signal_task = sparse_task + dense_task + history + 0.5 * sparse_task * history, where
      sparse_task  = sum over tables and ids of a random weight per (table, id)   (normalized),
      dense_task   = random linear function of the dense floats                     (normalized),
      history      = per sequence: sum over valid events of (item score + action score) / sqrt(len),
                     item scores centered and scaled under the Zipf item distribution.
    It is standardized with a calibration draw; p_click = sigmoid(b_ctr + domain_bias + 1.5 z_ctr) and
    p_convert|click = sigmoid(b_cvr + domain_bias + 1.5 z_cvr), with b_ctr, b_cvr solved by bisection
    so that the mean CTR / CVR of the calibration draw hit cfg.ctr_target / cfg.cvr_target.
    """

    def __init__(self, cfg: DataConfig, data: SyntheticData) -> None:
        self.cfg = cfg
        gen = _generator(cfg.seed, _STREAM_TEACHER)
        self.buckets = min(cfg.table_rows, _TEACHER_SPARSE_BUCKETS)
        self.sparse_w = torch.randn(2, cfg.n_sparse_tables, self.buckets, generator=gen, dtype=torch.float64)
        self.dense_w = torch.randn(2, cfg.n_dense, generator=gen, dtype=torch.float64)
        self.domain_bias = 0.5 * torch.randn(2, cfg.n_domains, generator=gen, dtype=torch.float64)
        # Item scores, centered and unit-variance under the Zipf item distribution, so the history sum
        # has no drift with length.
        score = torch.randn(cfg.item_vocab, generator=gen, dtype=torch.float64)
        score[0] = 0.0
        p_item = torch.zeros(cfg.item_vocab, dtype=torch.float64)
        p_item[data._item_of_rank] = data._item_ranks.probs
        mean = (p_item * score).sum()
        std = ((p_item * (score - mean) ** 2).sum()).sqrt().clamp_min(1e-6)
        self.item_score = (score - mean) / std
        action_w = torch.randn(cfg.n_actions, generator=gen, dtype=torch.float64)
        self.action_score = action_w - (data._action_probs * action_w).sum()
        mean_hot = max(1.0, cfg.max_hot / 2)
        self.sparse_norm = 1.0 / math.sqrt(cfg.n_sparse_tables * mean_hot)
        # The calibration depends on neither batch_size, n_tasks nor batch_shuffle: share it between
        # configs that differ only there.
        key = dataclasses.replace(cfg, batch_size=1, n_tasks=2, batch_shuffle=False)
        if key not in _CALIBRATION_CACHE:
            _CALIBRATION_CACHE[key] = self._calibrate(data)
        self.signal_mean, self.signal_std, self.bias = _CALIBRATION_CACHE[key]

    def signal(self, f: dict[str, object]) -> Tensor:
        """Raw teacher signal, float64 (B, 2) (CTR, CVR)."""
        ids = f["sparse_ids"]
        table = torch.arange(ids.shape[1])[None, :, None]
        w = self.sparse_w[:, table, ids % self.buckets] * (ids > 0)  # (2, B, T, H)
        sparse = w.sum((2, 3)).T * self.sparse_norm  # (B, 2)
        dense = f["dense"].to(torch.float64) @ self.dense_w.T / math.sqrt(self.cfg.n_dense)  # (B, 2)
        history = torch.zeros(ids.shape[0], dtype=torch.float64)
        for items, actions, lengths in zip(f["seq_items"], f["seq_actions"], f["seq_lengths"]):
            valid = torch.arange(items.shape[1])[None, :] < lengths[:, None]
            event = (self.item_score[items] + 0.5 * self.action_score[actions]) * valid
            history += event.sum(1) / lengths.clamp_min(1).to(torch.float64).sqrt()
        history = (history / math.sqrt(len(f["seq_items"])))[:, None]
        return sparse + dense + history + 0.5 * sparse * history

    def _probabilities(self, z: Tensor, domain: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
        logit = bias[None, :] + self.domain_bias[:, domain].T + _TEACHER_SCALE * z
        p = torch.sigmoid(logit)
        return p[:, 0], p[:, 1]  # P(click), P(convert | click)

    def _calibrate(self, data: SyntheticData) -> tuple[Tensor, Tensor, Tensor]:
        """(signal mean, signal std, [b_ctr, b_cvr]) from a fixed calibration draw."""
        gen = _generator(self.cfg.seed, _STREAM_CALIBRATION)
        signals, domains = [], []
        lo, hi = _CALIBRATION_SAMPLES
        n_samples = max(lo, min(hi, _CALIBRATION_TOKENS // sum(self.cfg.seq_max_lens)))
        for _ in range(0, n_samples, _CALIBRATION_CHUNK):
            f = data._draw_features(_CALIBRATION_CHUNK, gen)
            signals.append(self.signal(f))
            domains.append(f["domain"])
        raw, domain = torch.cat(signals), torch.cat(domains)
        signal_mean, signal_std = raw.mean(0), raw.std(0).clamp_min(1e-6)
        z = (raw - signal_mean) / signal_std

        def solve(rate_of_bias, target: float) -> float:
            lo, hi = -30.0, 30.0
            for _ in range(50):
                mid = 0.5 * (lo + hi)
                if rate_of_bias(mid) < target:
                    lo = mid
                else:
                    hi = mid
            return 0.5 * (lo + hi)

        def ctr(b: float) -> float:
            p_click, _ = self._probabilities(z, domain, torch.tensor([b, 0.0], dtype=torch.float64))
            return float(p_click.mean())

        b_ctr = solve(ctr, self.cfg.ctr_target)

        def cvr(b: float) -> float:
            p_click, p_convert = self._probabilities(z, domain, torch.tensor([b_ctr, b], dtype=torch.float64))
            return float((p_click * p_convert).mean())

        b_cvr = solve(cvr, self.cfg.cvr_target)
        return signal_mean, signal_std, torch.tensor([b_ctr, b_cvr], dtype=torch.float64)

    def draw_labels(self, f: dict[str, object], gen: torch.Generator) -> tuple[Tensor, Tensor]:
        z = (self.signal(f) - self.signal_mean) / self.signal_std
        p_click, p_convert = self._probabilities(z, f["domain"], self.bias)
        b = p_click.shape[0]
        click = torch.rand(b, generator=gen, dtype=torch.float64) < p_click
        convert = click & (torch.rand(b, generator=gen, dtype=torch.float64) < p_convert)
        window_closed = torch.rand(b, generator=gen) < LABEL_WINDOW_CLOSED_PROB
        labels = torch.stack([click, convert], 1).to(torch.float32)
        label_mask = torch.stack([torch.ones(b, dtype=torch.bool), window_closed], 1)
        n_tasks = self.cfg.n_tasks
        return labels[:, :n_tasks].contiguous(), label_mask[:, :n_tasks].contiguous()
