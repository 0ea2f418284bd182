"""Why the packed attention path is not FlexAttention on the CPU (issue 21, item 3): a decode
step of B sequences over a paged KV (16-slot blocks, bench-checkpoint head shapes), one layer,
through visor's packed path (gather the sequences' blocks, one masked SDPA call) and through
FlexAttention compiled over the same paged storage with a BlockMask built from the block tables.
`python -m bench.flex_attention` prints one JSON object (bench/results/flex_attention.json)."""

import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

torch.set_num_threads(1)
B, H, KVH, D, BS, CTX = 16, 12, 4, 64, 16, 592
NB = B * (CTX // BS + 2) + 1
g = torch.Generator().manual_seed(0)
keys = torch.randn(KVH, NB, BS, D, generator=g)
values = torch.randn(KVH, NB, BS, D, generator=g)
nblk = -(-CTX // BS)
tables = torch.randperm(NB - 1, generator=g)[: B * nblk].view(B, nblk) + 1
q = torch.randn(H, B, D, generator=g)
group = H // KVH


def sdpa_packed():
    qq = q.view(KVH, group, B, 1, D).permute(2, 0, 1, 3, 4).reshape(B, KVH, group, D)
    k = keys.index_select(1, tables.flatten()).view(KVH, B, nblk * BS, D).transpose(0, 1)
    v = values.index_select(1, tables.flatten()).view(KVH, B, nblk * BS, D).transpose(0, 1)
    mask = torch.arange(nblk * BS) < CTX
    return F.scaled_dot_product_attention(qq, k, v, attn_mask=mask.view(1, 1, 1, -1))


# Flex: queries of all sequences as one "batch 1" of B query rows, keys = the whole paged store
# flattened (NB*BS slots); the mask lets query b see slots of its own blocks below CTX.
slot_seq = torch.full((NB * BS,), -1, dtype=torch.long)
slot_pos = torch.zeros(NB * BS, dtype=torch.long)
for b in range(B):
    for j, blk in enumerate(tables[b].tolist()):
        slot_seq[blk * BS : (blk + 1) * BS] = b
        slot_pos[blk * BS : (blk + 1) * BS] = torch.arange(j * BS, (j + 1) * BS)


def mask_mod(bi, h, qi, ki):
    return (slot_seq[ki] == qi) & (slot_pos[ki] < CTX)


t0 = time.perf_counter()
bm = create_block_mask(mask_mod, 1, None, B, NB * BS, device="cpu")
mask_ms = (time.perf_counter() - t0) * 1000
kf = keys.view(KVH, NB * BS, D)[None]
vf = values.view(KVH, NB * BS, D)[None]
qf = q[None]  # (1, H, B, D)
flex = torch.compile(flex_attention, dynamic=False)


def flex_call():
    return flex(qf, kf, vf, block_mask=bm, enable_gqa=True)


t0 = time.perf_counter()
flex_call()
compile_s = time.perf_counter() - t0
ref = sdpa_packed()  # (B, KVH, group, D)
out = flex_call()[0]  # (H, B, D)
ref_h = ref.reshape(B, H, D).transpose(0, 1)
err = (out - ref_h).abs().max().item()


def timeit(fn, n=30):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2] * 1000


print(
    json.dumps(
        {
            "B": B,
            "ctx": CTX,
            "sdpa_packed_ms": round(timeit(sdpa_packed), 3),
            "flex_compiled_ms": round(timeit(flex_call), 3),
            "flex_compile_s": round(compile_s, 1),
            "block_mask_ms": round(mask_ms, 1),
            "max_abs_diff": err,
        }
    )
)
