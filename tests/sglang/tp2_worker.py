"""One rank of the TP=2 CPU run (two processes, gloo): ``python tp2_worker.py RANK PORT OUTDIR``.

Each rank builds the same random HF Llama, loads it into SGLang's LlamaForCausalLM (SGLang's loaders
shard it), runs EXTEND + TARGET_VERIFY stock and then with the plugin, and saves what it saw."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness as h  # noqa: E402

PROMPTS = [[5, 17, 3, 99, 42], [7, 1, 64, 23, 88, 120, 11]]
DRAFTS = [[9, 31, 2, 77], [54, 6, 101, 13]]
LAYER_IDS = [0, 1, 2]


def two_forwards(model, cfg, dtype, tp_size):
    kv = h.KVCache(cfg, dtype, tp_size=tp_size)
    reqs = [h.Req(kv.new_req()) for _ in PROMPTS]
    ext = h.run(model, h.extend_batch(kv, reqs, PROMPTS), kv)
    out = {"extend_aux": ext.hidden_states.clone(), "extend_logits": ext.next_token_logits.clone()}
    ver = h.run(model, h.extend_batch(kv, reqs, DRAFTS, mode="TARGET_VERIFY"), kv)
    out.update(verify_aux=ver.hidden_states.clone(), verify_logits=ver.next_token_logits.clone())
    return out


def main(rank: int, port: int, outdir: str) -> None:
    h.disable_dynamo()
    import torch

    h.init_distributed(tp_size=2, rank=rank, port=port)
    assert h.plugin_install()
    from eagle3_ops.sglang.capture_hooks import capture_state

    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        cfg = h.FAMILIES["llama"].make_config()
        hf = h.hf_model("llama", cfg, dtype)
        model = h.sglang_from_hf("llama", cfg, dtype, hf)
        assert model.model.layers[0].self_attn.num_heads == cfg.num_attention_heads // 2  # really sharded
        model.set_eagle3_layers_to_capture(LAYER_IDS)
        stock = two_forwards(model, cfg, dtype, 2)
        h.configure_capture(model, LAYER_IDS)
        plugin = two_forwards(model, cfg, dtype, 2)
        state = capture_state(model)
        results[str(dtype)] = {"stock": stock, "plugin": plugin, "stats": dict(state.stats),
                               "reference_only": h.reference_only(dtype)}
    # the states dump at TP=2: both ranks run it (same environment, as in a server); rank 0 writes
    os.environ["EAGLE3_OPS_DUMP_STATES"] = os.path.join(outdir, "states.safetensors")
    os.environ["EAGLE3_OPS_DUMP_TOKENS"] = str(sum(map(len, PROMPTS)))
    from eagle3_ops.sglang.dump_states import dump_state

    cfg = h.FAMILIES["llama"].make_config()
    model = h.sglang_from_hf("llama", cfg, torch.float32, h.hf_model("llama", cfg, torch.float32))
    h.configure_capture(model, LAYER_IDS)
    rec = dump_state(model)
    kv = h.KVCache(cfg, torch.float32, tp_size=2)
    h.run(model, h.extend_batch(kv, [h.Req(kv.new_req()) for _ in PROMPTS], PROMPTS), kv)
    results["dump"] = {"tp_rank": rec.tp_rank, "tp_size": rec.tp_size, "keeps_values": rec.keep_values,
                       "done": rec.done}
    torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
