import os, time, tempfile, statistics, torch, sys
from pathlib import Path
from vllm_interp.capture import isolation
from vllm_interp.capture.consumers import filesystem as fs
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else torch.get_num_threads())
print("torch threads", torch.get_num_threads())
chunks = [torch.randn(16, 1, 2048).to(torch.bfloat16) for _ in range(512)]
nbytes = 16 * 512 * 2048 * 2
d = Path(tempfile.mkdtemp(dir="/dev/shm"))
b = isolation._SharedBlock(d)
def t(f, n=5):
    f(); s = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - s) / n * 1e3
b.fit(nbytes)
def gather():
    x = b.tensor((16, 512, 2048), torch.bfloat16); torch.cat(chunks, dim=1, out=x); del x
print("gather into reused shm block ms", round(t(gather), 2))
src = torch.empty(16, 512, 2048, dtype=torch.bfloat16); torch.cat(chunks, dim=1, out=src)
tensors = {f"{i}.post_block": src[i] for i in range(16)}
mem = fs._ShardMemory()
def copy_in():
    mem.copy_in(tensors, 256 << 20); mem.hand_over() and None
    mem._spare = mem._spare or []
buf = torch.empty(256 << 20, dtype=torch.uint8)
def copy_plain():
    buf[:nbytes].view(torch.bfloat16).view(16, 512, 2048).copy_(src)
print("copy 34MB into reused buffer ms", round(t(copy_plain), 2))
root = Path(tempfile.mkdtemp(dir=sys.argv[2] if len(sys.argv) > 2 else "/tmp"))
batch = {f"r{i}": fs._Pending({k: buf[i*nbytes:(i+1)*nbytes].view(torch.bfloat16).view(16,512,2048)[j] for j, k in enumerate(tensors)}, {"base": f"r{i}"}, nbytes) for i in range(7)}
for n in range(3):
    s = time.perf_counter(); fs._publish_shard(root / "shards" / f"shard-{n:05d}.safetensors", batch); e = time.perf_counter() - s
    print("publish shard of 7 requests MB/s", round(7 * nbytes / 1e6 / e))
data = os.urandom(7 * nbytes)
fd, p = tempfile.mkstemp(dir=root)
s = time.perf_counter(); os.write(fd, data); os.fsync(fd); e = time.perf_counter() - s
print("plain write MB/s", round(7 * nbytes / 1e6 / e))
