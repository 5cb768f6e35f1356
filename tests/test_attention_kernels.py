"""The torch models' attention and K/V-cache write: the half-precision grouped path against
float32 SDPA, and the one-write fast path against the per-row copies it replaces."""
import torch
import torch.nn.functional as F

from saguaro.runtime.models.llama import attend, write_cache


def reference_attention(q, keys, values, mask):
    """float32 SDPA with every K/V head repeated for its query group."""
    groups = q.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(groups, dim=1)
    values = values.float().repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q.float(), keys, values, attn_mask=mask.unsqueeze(1))


def test_bfloat16_attention_matches_float32_sdpa_per_query_group():
    torch.manual_seed(0)
    batch, heads, kv_heads, n, total, dim = 3, 6, 2, 4, 9, 8
    q = torch.randn(batch, heads, n, dim)
    keys, values = torch.randn(batch, kv_heads, total, dim), torch.randn(batch, kv_heads, total, dim)
    mask = torch.rand(batch, n, total) < 0.7
    mask[..., 0] = True  # every query sees something
    got = attend(q.bfloat16(), keys.bfloat16(), values.bfloat16(), mask)
    want = reference_attention(q.bfloat16(), keys.bfloat16(), values.bfloat16(), mask)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert (got.float() - want).abs().max() < 0.03  # bf16 rounding of the weights and output
    # a query head must read its own K/V head: swapping the K/V heads changes the answer
    swapped = attend(q.bfloat16(), keys.flip(1).bfloat16(), values.flip(1).bfloat16(), mask)
    assert (swapped.float() - want).abs().max() > 0.1


def test_a_fully_masked_query_gives_numbers_not_nan():
    q, kv = torch.randn(1, 2, 1, 4).bfloat16(), torch.randn(1, 1, 3, 4).bfloat16()
    out = attend(q, kv, kv, torch.zeros(1, 1, 3, dtype=torch.bool))
    assert torch.isfinite(out.float()).all()


def per_row(keys, values, k, v, past, counts):
    for row, (start, count) in enumerate(zip(past.tolist(), counts.tolist())):
        keys[row, :, start:start + count] = k[row, :, :count]
        values[row, :, start:start + count] = v[row, :, :count]


def test_cache_writes_equal_per_row_copies_uniform_and_ragged():
    torch.manual_seed(1)
    for counts in ([3, 3, 3], [3, 1, 2]):
        k, v = torch.randn(3, 2, 3, 4), torch.randn(3, 2, 3, 4)
        past, counts_t = torch.tensor([0, 5, 2]), torch.tensor(counts)
        fast = torch.zeros(2, 3, 2, 10, 4)
        slow = fast.clone()
        write_cache(fast[0], fast[1], k, v, past, counts_t)
        per_row(slow[0], slow[1], k, v, past, counts_t)
        assert torch.equal(fast, slow)
        assert fast.abs().sum() > 0
