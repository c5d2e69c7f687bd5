"""Quick GPU check of the engine harness and the V2 runner adapter (prints timings as it goes)."""
import time

if __name__ == "__main__":
    t = time.time()
    import torch
    import interlace
    from interlace import ops
    print("import", round(time.time() - t, 1), flush=True)
    model = interlace.Model("tiny-llama")
    print("config", model.config, flush=True)
    model.engine
    print("engine up", round(time.time() - t, 1), flush=True)
    out = model.generate("The capital of France is", max_tokens=4)
    print("plain", out.token_ids, round(time.time() - t, 1), flush=True)
    out = model.generate("The capital of France is", ops=[ops.save("layers.1.resid")], max_tokens=3)
    print("op save", {k: tuple(v.shape) for k, v in out.saves.items()}, round(time.time() - t, 1), flush=True)
    def prog(m):
        m.layers[1].resid += 1.0
        m.save("lg", m.logits)
        if m.step == 1:
            m.samples = torch.tensor([42], device=m.samples.device)
    out = model.generate("The capital of France is", program=prog, max_tokens=3, ignore_eos=True)
    print("program", out.token_ids, {k: tuple(v.shape) for k, v in out.saves.items()}, round(time.time() - t, 1), flush=True)
    model.close()
    print("closed", round(time.time() - t, 1), flush=True)
