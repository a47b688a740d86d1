"""Host<->device copy rates on this machine (what a direct weight publish/pull pays on a GPU host)."""
import json, time
import jax, jax.numpy as jnp, numpy as np
n = 600 * 2**20  # 1.2 GB of bfloat16: Qwen3-0.6B's size
x = jnp.ones((n,), jnp.bfloat16); x.block_until_ready()
host = np.asarray(jax.device_get(x))
def med(f, k=5):
    ts = []
    for _ in range(k):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return sorted(ts)[k // 2]
d2h = med(lambda: np.asarray(jax.device_get(x + 0)))  # fresh array each time: no cached host copy
d2h_only = d2h - med(lambda: (x + 0).block_until_ready())
h2d = med(lambda: jax.device_put(host).block_until_ready())
print(json.dumps({"bench": "host_link", "bytes": host.nbytes, "d2h_gbps": round(host.nbytes / d2h_only / 1e9, 2),
                  "h2d_gbps": round(host.nbytes / h2d / 1e9, 2), "device": str(jax.devices()[0])}))
