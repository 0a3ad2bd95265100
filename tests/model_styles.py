"""Attention modules written the way public recommendation and transformer code writes them, for the
tests (tests/integration/test_real_model_masks.py) and the benchmark (benchmarks/data_masks.py).

Written from the public behaviour of the models they are named after; no third-party code is copied.
Every module takes ``heads`` and ``head_dim``; its width is heads * head_dim.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class _Attention(nn.Module):
    def __init__(self, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim, self.width = heads, head_dim, heads * head_dim

    def split(self, x):
        return x.view(x.shape[0], x.shape[1], self.heads, self.head_dim).transpose(1, 2)

    def merge(self, x):
        return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], self.width)


class BertStyleSelfAttention(_Attention):
    """HF BERT: mask (B, L) of 1 (token) / 0 (padding), extended to (1 - m) * finfo.min and added."""

    def __init__(self, heads: int, head_dim: int, sdpa: bool = False, attention_dropout: float = 0.1):
        super().__init__(heads, head_dim)
        e = self.width
        self.query, self.key, self.value = nn.Linear(e, e), nn.Linear(e, e), nn.Linear(e, e)
        self.dropout = nn.Dropout(attention_dropout)
        self.sdpa = sdpa

    def forward(self, hidden, attention_mask):
        extended = attention_mask[:, None, None, :].to(dtype=hidden.dtype)
        extended = (1.0 - extended) * torch.finfo(hidden.dtype).min
        q, k, v = self.split(self.query(hidden)), self.split(self.key(hidden)), self.split(self.value(hidden))
        if self.sdpa:
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=extended,
                                                     dropout_p=self.dropout.p if self.training else 0.0)
        else:
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
            probs = self.dropout(nn.functional.softmax(scores + extended, dim=-1))
            context = torch.matmul(probs, v)
        return self.merge(context)


class BertStyleLayer(nn.Module):
    """A BERT encoder layer: self-attention, output projection, residual + LayerNorm, GELU feed-forward.
    Attention dropout defaults to 0 here, so that a layer in train() compares with eager numerically."""

    def __init__(self, heads: int, head_dim: int, attention_dropout: float = 0.0):
        super().__init__()
        e = heads * head_dim
        self.attention = BertStyleSelfAttention(heads, head_dim, attention_dropout=attention_dropout)
        self.output = nn.Linear(e, e)
        self.norm1, self.norm2 = nn.LayerNorm(e), nn.LayerNorm(e)
        self.ffn = nn.Sequential(nn.Linear(e, 4 * e), nn.GELU(), nn.Linear(4 * e, e))

    def forward(self, hidden, attention_mask):
        hidden = self.norm1(hidden + self.output(self.attention(hidden, attention_mask)))
        return self.norm2(hidden + self.ffn(hidden))


class IndexedBoolMaskAttention(_Attention):
    """transformers 5: the boolean mask is padding_mask[batch_idx, kv_idx] over broadcast index tensors;
    with ``query_floor`` and-ed with ``q_idx >= query_floor`` (its bidirectional mask function is
    ``q_idx >= 0``: true at every query, and the encoders' masks carry it)."""

    def __init__(self, heads: int, head_dim: int, query_floor: int | None = None):
        super().__init__(heads, head_dim)
        self.qkv = nn.Linear(self.width, 3 * self.width)
        self.query_floor = query_floor

    def forward(self, hidden, attention_mask):
        batch_idx = torch.arange(hidden.shape[0], device=hidden.device)[:, None, None, None]
        kv_idx = torch.arange(hidden.shape[1], device=hidden.device)[None, None, None, :]
        allowed = attention_mask.bool()[batch_idx, kv_idx]
        if self.query_floor is not None:
            q_idx = torch.arange(hidden.shape[1], device=hidden.device)[None, None, :, None]
            allowed = (q_idx >= self.query_floor) & allowed
        q, k, v = (self.split(t) for t in self.qkv(hidden).chunk(3, dim=-1))
        return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed))


class SASRecBlock(nn.Module):
    """SASRec: item ids (0 = padding), a causal attn_mask and (optionally) a key_padding_mask from the ids on
    nn.MultiheadAttention, a timeline mask on the outputs, a point-wise feed-forward."""

    def __init__(self, heads: int, head_dim: int, key_padding: bool = True, dropout: float = 0.0):
        super().__init__()
        e = heads * head_dim
        self.norm = nn.LayerNorm(e)
        self.attention = nn.MultiheadAttention(e, heads, dropout=dropout, batch_first=True)
        self.ffn = nn.Sequential(nn.Linear(e, e), nn.ReLU(), nn.Linear(e, e))
        self.key_padding = key_padding

    def forward(self, seqs, ids):
        timeline = ids == 0
        seqs = seqs * ~timeline.unsqueeze(-1)
        causal = ~torch.tril(torch.ones((seqs.shape[1], seqs.shape[1]), dtype=torch.bool, device=seqs.device))
        q = self.norm(seqs)
        out, _ = self.attention(q, seqs, seqs, attn_mask=causal,
                                key_padding_mask=timeline if self.key_padding else None)
        seqs = q + out
        seqs = seqs + self.ffn(seqs)
        return seqs * ~timeline.unsqueeze(-1)


class Bert4RecAttention(_Attention):
    """BERT4Rec: mask = (x > 0).unsqueeze(1).repeat(1, L, 1).unsqueeze(1), masked_fill(mask == 0, -1e9),
    dropout on the attention probabilities."""

    def __init__(self, heads: int, head_dim: int, dropout: float = 0.1):
        super().__init__(heads, head_dim)
        self.linears = nn.ModuleList([nn.Linear(self.width, self.width) for _ in range(3)])
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden, ids):
        mask = (ids > 0).unsqueeze(1).repeat(1, ids.size(1), 1).unsqueeze(1)
        q, k, v = (self.split(lin(hidden)) for lin in self.linears)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        scores = scores.masked_fill(mask == 0, -1e9)
        return self.merge(torch.matmul(self.dropout(F.softmax(scores, dim=-1)), v))


class HstuStyleAttention(_Attention):
    """An HSTU layer: lengths from offsets, causal written as eye | (row - col > 0), silu(q k^T * alpha) / N
    times the mask, einsum for the products."""

    def __init__(self, heads: int, head_dim: int):
        super().__init__(heads, head_dim)
        self.uvqk = nn.Linear(self.width, 4 * self.width)

    def forward(self, x, seq_offsets):
        n = x.shape[1]
        lengths = seq_offsets[1:] - seq_offsets[:-1]
        _, v, q, k = (self.split(t) for t in F.silu(self.uvqk(x)).chunk(4, dim=-1))
        ids = torch.arange(0, n, device=x.device).view(1, n)
        row_ids = ids.view(n, 1).expand(n, n)
        col_ids = row_ids.t()
        dist = row_ids.view(1, n, n) - col_ids.view(1, n, n)
        valid = torch.logical_or(torch.eye(n, dtype=torch.bool, device=x.device).view(1, n, n), dist > 0)
        keys = (torch.arange(n, device=x.device)[None, :] < lengths[:, None]).view(-1, 1, n)
        attn = F.silu(torch.einsum("bhxa,bhya->bhxy", q, k) * (1.0 / math.sqrt(self.head_dim))) / n
        attn = attn * (valid & keys).unsqueeze(1)
        return self.merge(torch.einsum("bhxd,bhdv->bhxv", attn, v))


class LeftPaddedCausal(_Attention):
    """Right-aligned sequences: key j valid iff j >= L - length, with causal, through SDPA."""

    def __init__(self, heads: int, head_dim: int):
        super().__init__(heads, head_dim)
        self.qkv = nn.Linear(self.width, 3 * self.width)

    def forward(self, hidden, lengths):
        n = hidden.shape[1]
        keep = torch.arange(n, device=hidden.device)[None, :] >= n - lengths[:, None]
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool, device=hidden.device))
        q, k, v = (self.split(t) for t in self.qkv(hidden).chunk(3, dim=-1))
        return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :] & causal))


class EncoderLayerCausal(nn.Module):
    """nn.TransformerEncoderLayer with a float causal src_mask and a bool src_key_padding_mask (torch warns
    about the mismatched types while tracing)."""

    def __init__(self, heads: int, head_dim: int):
        super().__init__()
        e = heads * head_dim
        self.layer = nn.TransformerEncoderLayer(e, heads, 2 * e, dropout=0.0, batch_first=True)

    def forward(self, hidden, ids):
        causal = nn.Transformer.generate_square_subsequent_mask(hidden.shape[1], device=hidden.device)
        return self.layer(hidden, src_mask=causal, src_key_padding_mask=ids == 0)


class EncoderStackCausal(nn.Module):
    """nn.TransformerEncoder (a stack, here of one layer) called the way SASRec-style models call it: a causal
    mask (float from generate_square_subsequent_mask, or a bool triu) and a key padding mask, no is_causal
    hint, so torch checks whether the mask is causal (a read of its values Dynamo cannot trace)."""

    def __init__(self, heads: int, head_dim: int, bool_mask: bool = False):
        super().__init__()
        e = heads * head_dim
        self.bool_mask = bool_mask
        layer = nn.TransformerEncoderLayer(e, heads, 2 * e, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

    def forward(self, hidden, ids):
        n = hidden.shape[1]
        if self.bool_mask:
            causal = torch.triu(torch.ones(n, n, dtype=torch.bool, device=hidden.device), diagonal=1)
        else:
            causal = nn.Transformer.generate_square_subsequent_mask(n, device=hidden.device)
        return self.encoder(hidden, mask=causal, src_key_padding_mask=ids == 0)


class TransActStyle(nn.Module):
    """Pinterest's TransAct (transformer_user_action): the key padding mask comes from an action-type lookup
    (a buffer indexed by the ids: id 0 looks up 0, padding), every sequence keeps its first action
    (``mask[:, 0] = zeros(B)``, in place) and the mask goes to nn.TransformerEncoder as a float -inf mask."""

    def __init__(self, heads: int, head_dim: int, vocab: int = 64):
        super().__init__()
        e = heads * head_dim
        lookup = torch.zeros(vocab + 1, dtype=torch.long)
        lookup[2:] = torch.arange(1, vocab)  # lookup[id + 1] = id for ids >= 1, lookup[1] = 0 for padding
        self.register_buffer("action_type_lookup", lookup)
        layer = nn.TransformerEncoderLayer(e, heads, 2 * e, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

    def forward(self, hidden, ids):
        mask = self.action_type_lookup[ids + 1] <= 0
        mask[:, 0] = torch.zeros(mask.shape[0], dtype=mask.dtype, device=mask.device)
        padding = torch.zeros_like(mask, dtype=torch.float)
        padding.masked_fill_(mask, float("-inf"))
        return self.encoder(hidden, src_key_padding_mask=padding)


class MeantimeStyle(_Attention):
    """MEANTIME's SASRec: the key mask repeated over the query rows and made causal in place,
    ``m = (ids > 0).unsqueeze(1).repeat(1, L, 1).unsqueeze(1); m.tril_()``, then ``masked_fill(m == 0, -1e9)``."""

    def __init__(self, heads: int, head_dim: int):
        super().__init__(heads, head_dim)
        self.qkv = nn.Linear(self.width, 3 * self.width)

    def forward(self, hidden, ids):
        m = (ids > 0).unsqueeze(1).repeat(1, ids.shape[1], 1).unsqueeze(1)
        m.tril_()
        q, k, v = (self.split(t) for t in self.qkv(hidden).chunk(3, dim=-1))
        s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        s = s.masked_fill(m == 0, -1e9)
        return self.merge(torch.matmul(F.softmax(s, dim=-1), v))


class HstuResearchStyle(_Attention):
    """The research HSTU encoder's attention: a registered triu(ones, diagonal=1) buffer, used as
    1 - mask (float) times silu(q k^T) / n; padded positions are zeros and are dropped afterwards."""

    def __init__(self, heads: int, head_dim: int, max_len: int = 64):
        super().__init__(heads, head_dim)
        self.uvqk = nn.Linear(self.width, 4 * self.width)
        self.register_buffer("_attn_mask", torch.triu(torch.ones((max_len, max_len), dtype=torch.bool), diagonal=1))

    def forward(self, x, lengths):
        n = x.shape[1]
        x = x * (torch.arange(n, device=x.device)[None, :] < lengths[:, None])[..., None]  # zero padding
        _, v, q, k = (self.split(t) for t in F.silu(self.uvqk(x)).chunk(4, dim=-1))
        invalid_attn_mask = 1.0 - self._attn_mask[:n, :n].to(x.dtype)
        attn = F.silu(torch.einsum("bhnd,bhmd->bhnm", q, k)) / n
        attn = attn * invalid_attn_mask.unsqueeze(0).unsqueeze(0)
        return self.merge(torch.einsum("bhnm,bhmd->bhnd", attn, v))


class DistilBertStyleAttention(_Attention):
    """DistilBERT: q scaled first, mask = (m == 0).view(B, 1, 1, L).expand_as(scores), filled with
    torch.tensor(finfo.min)."""

    def __init__(self, heads: int, head_dim: int):
        super().__init__(heads, head_dim)
        self.q_lin, self.k_lin, self.v_lin = (nn.Linear(self.width, self.width) for _ in range(3))

    def forward(self, hidden, mask):
        q, k, v = self.split(self.q_lin(hidden)), self.split(self.k_lin(hidden)), self.split(self.v_lin(hidden))
        scores = torch.matmul(q / math.sqrt(self.head_dim), k.transpose(2, 3))
        dropped = (mask == 0).view(hidden.shape[0], 1, 1, hidden.shape[1]).expand_as(scores)
        scores = scores.masked_fill(dropped, torch.tensor(torch.finfo(scores.dtype).min))
        return self.merge(torch.matmul(nn.functional.softmax(scores, dim=-1), v))


class T5StyleAttention(_Attention):
    """HF T5 (the encoder of P5/TIGER-style generative recommenders): no 1/sqrt(d); a learned bias per
    relative-position bucket and head, summed with the (1 - m) * finfo.min padding mask into one
    position_bias, added to the scores in place; the softmax in fp32, cast back with type_as (or the sum
    given to SDPA as its attn_mask). ``gated``: transformers 5's SDPA integration instead, the bias written
    into a boolean mask, ``where(mask, position_bias, finfo.min)``, as SDPA's attn_mask."""

    def __init__(self, heads: int, head_dim: int, buckets: int = 8, sdpa: bool = False, gated: bool = False):
        super().__init__(heads, head_dim)
        self.q, self.k, self.v = (nn.Linear(self.width, self.width, bias=False) for _ in range(3))
        self.buckets, self.sdpa, self.gated = buckets, sdpa, gated
        self.relative_attention_bias = nn.Embedding(2 * buckets + 1, heads)

    def forward(self, hidden, attention_mask):
        n = hidden.shape[1]
        position = torch.arange(n, device=hidden.device)
        relative = (position[None, :] - position[:, None]).clamp(-self.buckets, self.buckets) + self.buckets
        position_bias = self.relative_attention_bias(relative).permute(2, 0, 1).unsqueeze(0)  # (1, H, L, L)
        if self.gated:
            keep = attention_mask.bool()[:, None, None, :].expand(-1, 1, n, -1)
            gated = torch.where(keep, position_bias, torch.finfo(hidden.dtype).min).contiguous()
            q, k, v = self.split(self.q(hidden)), self.split(self.k(hidden)), self.split(self.v(hidden))
            return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=gated, scale=1.0))
        extended = (1.0 - attention_mask[:, None, None, :].to(hidden.dtype)) * torch.finfo(hidden.dtype).min
        position_bias = position_bias + extended
        q, k, v = self.split(self.q(hidden)), self.split(self.k(hidden)), self.split(self.v(hidden))
        if self.sdpa:  # the summed bias and mask as SDPA's attn_mask, no scaling
            return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=position_bias, scale=1.0))
        scores = torch.matmul(q, k.transpose(3, 2))
        scores += position_bias
        weights = nn.functional.softmax(scores.float(), dim=-1).type_as(scores)
        return self.merge(torch.matmul(weights, v))


class RecBoleStyleAttention(_Attention):
    """RecBole's SASRec: mask = tril((ids != 0)[:, None, None, :].expand(B, 1, L, L)) as where(m, 0, -1e4),
    added to the scaled scores."""

    def __init__(self, heads: int, head_dim: int):
        super().__init__(heads, head_dim)
        self.query, self.key, self.value = (nn.Linear(self.width, self.width) for _ in range(3))

    def forward(self, hidden, item_seq):
        extended = (item_seq != 0).unsqueeze(1).unsqueeze(2)
        extended = torch.tril(extended.expand((-1, -1, item_seq.size(-1), -1)))
        extended = torch.where(extended, 0.0, -10000.0)
        q, k, v = self.split(self.query(hidden)), self.split(self.key(hidden)), self.split(self.value(hidden))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim) + extended
        return self.merge(torch.matmul(nn.functional.softmax(scores, dim=-1), v))


class FuxiCtrStyleAttention(_Attention):
    """FuxiCTR-style multi-head attention over a behaviour sequence: a float 0/1 mask from the item ids,
    viewed (B, 1, 1, L) and expanded over the heads, then inside the dot-product module viewed as the scores
    and applied in place, masked_fill_(mask.float() == 0, -1e9). ``target``: one query per sample (the
    candidate item, the first position here) attends to the history, as target attention does."""

    def __init__(self, heads: int, head_dim: int, target: bool = False):
        super().__init__(heads, head_dim)
        self.q, self.k, self.v = (nn.Linear(self.width, self.width, bias=False) for _ in range(3))
        self.target = target

    def forward(self, hidden, ids):
        b = hidden.shape[0]
        mask = (ids != 0).float().view(b, 1, 1, -1).expand(-1, self.heads, -1, -1)
        queries = hidden[:, :1] if self.target else hidden
        q, k, v = self.split(self.q(queries)), self.split(self.k(hidden)), self.split(self.v(hidden))
        scores = torch.matmul(q, k.transpose(-1, -2)) / self.head_dim ** 0.5
        if self.target:
            mask = mask.view_as(scores)  # (B, H, 1, L): the scores' own shape
        scores = scores.masked_fill_(mask.float() == 0, -1.0e9)
        out = self.merge(torch.matmul(scores.softmax(dim=-1), v))
        return out.expand(-1, hidden.shape[1], -1) if self.target else out


class FuxiCtrBstStyle(nn.Module):
    """FuxiCTR's BST (behavior sequence transformer) block: the dropped scores are padding_mask & ~eye (a
    padded query row sees the valid keys and itself), repeated over the heads into a (B * H, L, L) bool
    attn_mask for nn.MultiheadAttention(batch_first=True), in-place residual, LayerNorm, feed-forward."""

    def __init__(self, heads: int, head_dim: int):
        super().__init__()
        e = heads * head_dim
        self.heads = heads
        self.attention = nn.MultiheadAttention(e, heads, batch_first=True)
        self.norm = nn.LayerNorm(e)
        self.ffn = nn.Sequential(nn.Linear(e, e), nn.LeakyReLU(), nn.Linear(e, e))

    def forward(self, hidden, ids):
        length = ids.shape[1]
        padding = ids == 0
        dropped = padding.unsqueeze(1).repeat(1, length, 1) & ~torch.eye(length, dtype=torch.bool,
                                                                        device=ids.device)
        dropped = dropped.unsqueeze(1).repeat(1, self.heads, 1, 1).flatten(end_dim=1)
        attn, _ = self.attention(hidden, hidden, hidden, attn_mask=dropped)
        s = attn
        s += hidden
        s = self.norm(s)
        return s + self.ffn(s)


class TfSasRecStyleAttention(_Attention):
    """SASRec as its TensorFlow original writes attention (and its PyTorch ports keep): key masking by
    torch.where(key_masks == 0, paddings, scores) with paddings = ones_like(scores) * (-2 ** 32 + 1), the
    causal mask the same way from tril(ones), softmax, nan_to_num, then query masking in place: weights *=
    query_masks (the query rows of padding), before @ v."""

    def __init__(self, heads: int, head_dim: int):
        super().__init__(heads, head_dim)
        self.q, self.k, self.v = (nn.Linear(self.width, self.width) for _ in range(3))

    def forward(self, hidden, ids):
        q, k, v = self.split(self.q(hidden)), self.split(self.k(hidden)), self.split(self.v(hidden))
        scores = torch.matmul(q, k.transpose(-1, -2)) / self.head_dim ** 0.5
        paddings = torch.ones_like(scores) * (-2 ** 32 + 1)
        key_masks = (ids != 0).float()[:, None, None, :].expand_as(scores)
        scores = torch.where(key_masks == 0, paddings, scores)
        causal = torch.tril(torch.ones(ids.shape[1], ids.shape[1], device=ids.device))
        scores = torch.where(causal == 0, paddings, scores)
        weights = torch.nan_to_num(torch.softmax(scores, dim=-1))
        weights *= (ids != 0).float()[:, None, :, None]  # query masking
        return self.merge(torch.matmul(weights, v))


def hstu_valid_attn_mask(n: int, seq_lengths, num_targets=None, max_attn_len: int = 0, causal: bool = True,
                         contextual: int = 0):
    """generative-recommenders' visibility (as its PyTorch reference builds it): position ids shifted past the
    contextual prefix and clamped at the first target, causal as eye | (row - col > 0), the distance made
    absolute by ``torch.where`` when not causal, the contextual rows seeing every history key; no key-padding
    term."""
    device = seq_lengths.device
    ids = torch.arange(0, n, device=device).view(1, n)
    max_ids = seq_lengths.view(-1, 1, 1)
    if contextual > 0:
        ids = torch.clamp(ids - contextual + 1, min=0)
        max_ids = max_ids - contextual + 1
    if num_targets is not None:
        max_ids = max_ids - num_targets.view(-1, 1, 1)
        ids = torch.clamp(ids, max=max_ids)
        row_ids = ids.view(-1, n, 1).expand(-1, n, n)
        col_ids = ids.view(-1, 1, n).expand(-1, n, n)
    else:
        row_ids = ids.view(n, 1).expand(n, n)
        col_ids = row_ids.t()
        row_ids, col_ids = row_ids.view(1, n, n), col_ids.view(1, n, n)
    dist = row_ids - col_ids
    valid = torch.eye(n, dtype=torch.bool, device=device).view(1, n, n)
    if not causal:
        dist = torch.where(dist > 0, dist, -dist)
    valid = torch.logical_or(valid, dist > 0)
    if max_attn_len > 0:
        valid = torch.logical_and(valid, dist <= max_attn_len)
    if contextual > 0:
        valid = torch.logical_or(valid, torch.logical_and(row_ids == 0, col_ids < max_ids))
    return valid


class HstuTargetsStyle(_Attention):
    """HSTU with targets, mask without a padding term; ``drop_rows``: the output is multiplied by the valid
    rows afterwards (what makes padded rows irrelevant)."""

    def __init__(self, heads: int, head_dim: int, drop_rows: bool = True):
        super().__init__(heads, head_dim)
        self.uvqk = nn.Linear(self.width, 4 * self.width)
        self.drop_rows = drop_rows

    def forward(self, x, seq_offsets, num_targets):
        n = x.shape[1]
        lengths = seq_offsets[1:] - seq_offsets[:-1]
        _, v, q, k = (self.split(t) for t in F.silu(self.uvqk(x)).chunk(4, dim=-1))
        attn = F.silu(torch.einsum("bhxa,bhya->bhxy", q, k) * (1.0 / math.sqrt(self.head_dim))) / n
        attn = attn * hstu_valid_attn_mask(n, lengths, num_targets).unsqueeze(1)
        out = torch.einsum("bhxd,bhdv->bhxv", attn, v)
        if self.drop_rows:
            out = out * (torch.arange(n, device=x.device)[None, :] < lengths[:, None])[:, None, :, None]
        return self.merge(out)


class DinStyleAttention(nn.Module):
    """DIN (deep interest network) target attention: an MLP scores each history item against the candidate
    from [query, key, query - key, query * key]; padded history items (j >= length) get score 0, or a very
    negative one before a softmax with ``weight_normalization``; the output is the scores times the keys.
    No dot product of queries and keys: nothing the attention kernels compute. Takes (history (B, L, E),
    lengths (B,)); the candidate is a learned projection of the history's mean here."""

    def __init__(self, heads: int, head_dim: int, weight_normalization: bool = False):
        super().__init__()
        e = heads * head_dim
        self.candidate = nn.Linear(e, e)
        self.unit = nn.Sequential(nn.Linear(4 * e, 80), nn.Sigmoid(), nn.Linear(80, 40), nn.Sigmoid(),
                                  nn.Linear(40, 1))
        self.weight_normalization = weight_normalization

    def forward(self, history, lengths):
        b, n, e = history.shape
        query = self.candidate(history.mean(1, keepdim=True)).expand(b, n, e)
        scores = self.unit(torch.cat([query, history, query - history, query * history], dim=-1))  # (B, L, 1)
        scores = scores.transpose(1, 2)  # (B, 1, L)
        keep = (torch.arange(n, device=history.device)[None, :] < lengths[:, None])[:, None, :]
        if self.weight_normalization:
            scores = torch.softmax(torch.where(keep, scores, torch.full_like(scores, -2.0 ** 32 + 1)), dim=-1)
        else:
            scores = torch.where(keep, scores, torch.zeros_like(scores))
        return torch.matmul(scores, history)  # (B, 1, E)


class HstuUpstreamStyle(nn.Module):
    """HSTU attention as generative-recommenders' PyTorch reference writes it: jagged (T, E) tokens and
    seq_offsets in; q, k, v padded with ``torch.ops.fbgemm.jagged_to_padded_dense``; silu(q k^T * alpha) / N
    times the target-aware causal mask (no key-padding term); the output packed back with
    ``torch.ops.fbgemm.dense_to_jagged``, which drops the padded rows. Needs the fbgemm ops (or
    tests/fbgemm_standin.py)."""

    def __init__(self, heads: int, head_dim: int, max_len: int, **visibility):
        super().__init__()
        self.heads, self.head_dim, self.max_len = heads, head_dim, max_len
        self.visibility = visibility  # hstu_valid_attn_mask's causal, contextual, max_attn_len
        self.uvqk = nn.Linear(heads * head_dim, 4 * heads * head_dim)

    def _pad(self, x, seq_offsets):
        t = x.shape[0]
        padded = torch.ops.fbgemm.jagged_to_padded_dense(
            values=x.reshape(t, -1), offsets=[seq_offsets], max_lengths=[self.max_len], padding_value=0.0)
        return padded.view(-1, self.max_len, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x, seq_offsets, num_targets):
        total, n = x.shape[0], self.max_len
        _, v, q, k = F.silu(self.uvqk(x)).chunk(4, dim=-1)
        q, k, v = self._pad(q, seq_offsets), self._pad(k, seq_offsets), self._pad(v, seq_offsets)
        attn = F.silu(torch.einsum("bhxa,bhya->bhxy", q, k) * (1.0 / math.sqrt(self.head_dim))) / n
        mask = hstu_valid_attn_mask(n, seq_offsets[1:] - seq_offsets[:-1], num_targets, **self.visibility)
        attn = attn * mask.unsqueeze(1)
        dense = torch.einsum("bhxd,bhdv->bhxv", attn, v)
        return torch.ops.fbgemm.dense_to_jagged(dense.transpose(1, 2).flatten(2, 3), [seq_offsets], total)[0]


class StosaStyleAttention(_Attention):
    """STOSA (stochastic self-attention): each item a Gaussian (mean, ELU + 1 covariance); the scores are the
    negated 2-Wasserstein distance between query and key Gaussians (|mq|^2 - 2 mq.mk + |mk|^2 plus the same
    over square-rooted covariances) over sqrt(d), plus (1 - m) * (-2^32 + 1) from ids > 0 and the causal
    triangle; the weights meet the means and, squared, the covariances (``cov_values``). Not a scaled q k^T."""

    def __init__(self, heads: int, head_dim: int, cov_values: bool = True):
        super().__init__(heads, head_dim)
        self.cov_values = cov_values
        self.proj = nn.ModuleList(nn.Linear(self.width, self.width) for _ in range(6))

    @staticmethod
    def _distance(a, b):
        cross = torch.matmul(a, b.transpose(-1, -2))
        return -2 * cross + (a**2).sum(-1, keepdim=True) + (b**2).sum(-1, keepdim=True).transpose(-1, -2)

    def forward(self, x, ids):
        n = x.shape[1]
        keep = (ids > 0).long()[:, None, None, :] * (torch.triu(torch.ones(1, n, n), diagonal=1) == 0)[:, None].long()
        mask = (1.0 - keep.to(x.dtype)) * (-2**32 + 1)
        mq, mk, mv = (self.split(p(x)) for p in self.proj[:3])
        cq, ck, cv = (self.split(F.elu(p(x)) + 1) for p in self.proj[3:])
        root = lambda c: torch.sqrt(torch.clamp(c, min=1e-24))  # noqa: E731
        scores = -(self._distance(mq, mk) + self._distance(root(cq), root(ck))) / math.sqrt(self.head_dim)
        probs = torch.softmax(scores + mask, dim=-1)
        out = torch.matmul(probs, mv)
        return self.merge(out + torch.matmul(probs**2, cv) if self.cov_values else out)
