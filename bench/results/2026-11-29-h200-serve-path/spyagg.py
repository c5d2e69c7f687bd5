import sys, collections
for path in sys.argv[1:]:
    own, incl, total, threads = collections.Counter(), collections.Counter(), 0, collections.Counter()
    for line in open(path):
        stack, _, n = line.rstrip().rpartition(" ")
        n = int(n); total += n
        frames = stack.split(";")
        if frames[0].startswith("thread ") or frames[0].startswith("process "):
            threads[frames[0][:60]] += n
            frames = frames[1:] or ["?"]
        # drop thread name frames
        own[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    print(f"== {path}: {total} samples")
    print("  threads:", ", ".join(f"{t} {100*n/total:.0f}%" for t, n in threads.most_common(8)))
    print("  own:")
    for f, n in own.most_common(18): print(f"    {100*n/total:5.1f}%  {f[:150]}")
    print("  inclusive (interlace/vllm frames):")
    k = 0
    for f, n in incl.most_common(400):
        if any(w in f for w in ("interlace", "cluster/", "workers/", "driver/", "/vllm/", "serve/")) and k < 45:
            print(f"    {100*n/total:5.1f}%  {f[:150]}"); k += 1
