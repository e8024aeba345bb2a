"""Attention kernels on this CPU at ESM-2 35M head size (20 heads x 24 dims), milliseconds per call.

    python benchmarks/attention_kernels.py

Compares torch's fused SDPA (fp32 and bf16) with explicit-matmul attention (fp32, and bf16
matmuls with an fp32 softmax) for a few (batch, length) shapes with a padding mask.
"""
import torch, time
import torch.nn.functional as F
torch.set_num_threads(2)
def bench(fn, n=5):
    fn(); t=time.perf_counter()
    for _ in range(n): fn()
    return (time.perf_counter()-t)/n*1000
for (B,T) in [(12,340),(4,1024),(60,66)]:
    H,hd=20,24
    q=torch.randn(B,H,T,hd); k=torch.randn(B,H,T,hd); v=torch.randn(B,H,T,hd)
    mask=torch.ones(B,1,1,T,dtype=torch.bool); mask[0,...,T-30:]=False
    qb,kb,vb=q.bfloat16(),k.bfloat16(),v.bfloat16()
    def math(q,k,v,sdt):
        s=torch.matmul(q,k.transpose(-1,-2)).float().masked_fill(~mask,float('-inf'))
        p=torch.softmax(s,-1).to(sdt)
        return torch.matmul(p,v)
    r = {
     "sdpa fp32": bench(lambda: F.scaled_dot_product_attention(q,k,v,attn_mask=mask)),
     "sdpa bf16": bench(lambda: F.scaled_dot_product_attention(qb,kb,vb,attn_mask=mask)),
     "sdpa fp32 nomask": bench(lambda: F.scaled_dot_product_attention(q,k,v)),
     "math fp32": bench(lambda: math(q,k,v,torch.float32)),
     "math bf16mm fp32softmax": bench(lambda: math(qb,kb,vb,torch.bfloat16)),
    }
    print(B,T, {k:round(v,1) for k,v in r.items()})
