import time, torch
from interlace.workers.saves import host_copy
from interlace.workers.pinned import PinnedSlabs
dev = "cuda"
x = torch.randn(256, 2048, device=dev, dtype=torch.bfloat16)
h = torch.randn(4096, 2048, device=dev, dtype=torch.bfloat16)
idx = torch.arange(0, 4096, 16, device=dev)
slabs = PinnedSlabs()
def t(label, fn, n=2000):
    for _ in range(50): fn()
    torch.cuda.synchronize(); s = time.perf_counter()
    for _ in range(n): fn()
    e = time.perf_counter(); torch.cuda.synchronize()
    print(f"{label:40s} {1e6*(e-s)/n:7.1f} us/call")
t("host_copy (slab+copy+event)", lambda: host_copy(x, slabs))
host, slab = slabs.empty((256, 2048), torch.bfloat16)
t("copy_ non_blocking only", lambda: host.copy_(x, non_blocking=True))
t("Event()+record", lambda: torch.cuda.Event().record())
t("slabs.empty", lambda: slabs.release(slabs.empty((256, 2048), torch.bfloat16)[1]))
t("index_select", lambda: h.index_select(0, idx))
t("resid read (2 sel + add)", lambda: h.index_select(0, idx) + h.index_select(0, idx))
import numpy as np
rows = np.arange(0, 4096, 16)
t("index upload pin+to", lambda: torch.from_numpy(rows).pin_memory().to(dev, non_blocking=True))
t("empty kernel launch (add_)", lambda: x.add_(0))
