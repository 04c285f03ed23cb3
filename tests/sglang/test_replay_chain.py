"""The replay's later draft steps (``doctor --replay-steps S``): SGLang's own EAGLE-3 head fed its own outputs as
SGLang's EAGLE worker feeds it (the draft extend, then DECODE steps on the head's own hidden states).

The batched chain (every position's chain in one batch, their first KV slots shared with the one draft extend
through SGLang's req_to_token table) is held to the plain way: for each position a request of its own, the draft
extend over its prefix, then one DECODE forward per step, as a server runs one request. The acceptance counts are
held to a hand count over the same predictions.
"""
from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from eagle3_ops.doctor.tiny import build_tiny_pair

    return build_tiny_pair(tmp_path_factory.getbasetemp() / "doctor_tiny_pair")


@pytest.fixture(scope="module")
def runner_and_chunk(sglang_cpu, pair, tmp_path_factory):
    from eagle3_ops.doctor import cli, configs, replay
    from eagle3_ops.doctor.search import chunks
    from eagle3_ops.doctor.sglang_draft import SGLangDraftRunner

    states_file = tmp_path_factory.mktemp("chain") / "states.safetensors"
    assert cli.capture_states_main(["--model", str(pair.target_dir), "--prompts", str(pair.prompts_file),
                                    "--out", str(states_file), "--dtype", "float32"]) == 0
    target, draft = configs.parse_target(pair.target_dir), configs.parse_draft(pair.draft_dir)
    weights = configs.read_weight_headers(pair.draft_dir)
    states = replay.load_states(states_file, target)
    ids = torch.unique(torch.cat([g["ids"].reshape(-1) for g in states.groups]))
    runner = SGLangDraftRunner(draft, weights, ids, max_positions=64)
    chunk = chunks(states, 64, runner.uses_target_embeddings)[0]
    return runner, chunk, states, states_file


def _sequential(runner, aux, ids, embeds, j, steps):
    """Position j's chain as a server runs one request: the draft extend over positions 0..j, then DECODE steps,
    each on the head's own hidden state of the step before and the next prompt token."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput, EagleDraftInput

    h = runner.harness
    tokens = ids[0, :j + steps]
    if runner.token_rows is not None:
        tokens = runner.token_rows[tokens]
    elif runner.uses_target_embeddings:
        tokens = torch.zeros_like(tokens)
    kv = h.KVCache(runner.config, runner.dtype, size=j + steps + 4, max_reqs=2, max_context=j + steps + 4)
    req = h.Req(kv.new_req())
    spec = EagleDraftExtendInput(hidden_states=aux[0, :j + 1].to(runner.dtype).contiguous(),
                                 num_tokens_per_req=j + 1, num_tokens_for_logprob_per_req=j + 1)
    spec.select_index = None
    fb = h.extend_batch(kv, [req], [tokens[:j + 1].tolist()], mode="DRAFT_EXTEND_V2", capture="FULL", spec_info=spec)

    def forward(fb, emb):
        kv.backend.init_forward_metadata(fb)
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=kv.backend)):
            return runner.model(fb.input_ids, fb.positions, fb, input_embeds=emb)

    out = forward(fb, embeds[0, :j + 1] if runner.uses_target_embeddings else None)
    preds, hidden = [runner._to_target(out.next_token_logits[-1:].argmax(-1))], out.hidden_states[-1:]
    for k in range(2, steps + 1):
        fb = h.decode_batch(kv, [req], [int(tokens[j + k - 1])], capture="LAST",
                            spec_info=EagleDraftInput(hidden_states=hidden.contiguous()))
        out = forward(fb, embeds[0, j + k - 1:j + k] if runner.uses_target_embeddings else None)
        preds.append(runner._to_target(out.next_token_logits.argmax(-1)))
        hidden = out.hidden_states
    return [int(p) for p in preds]


def test_the_batched_chain_is_what_sglang_computes_for_one_request(runner_and_chunk):
    runner, c, _, _ = runner_and_chunk
    aux = torch.cat([c.bounds[b] for b in (3, 5, 7)], dim=-1)[:1]
    ids, embeds = c.ids[:1], c.embeds[:1] if c.embeds is not None else None
    steps = 3
    chain = runner.chain(aux, ids, embeds, steps)
    n = ids.shape[1]
    assert [p.numel() for p in chain] == [n, n - 1, n - 2]
    assert torch.equal(chain[0], runner.predict(aux, ids, embeds)[0])  # step 1 is the replay's first step
    for j in (0, 1, 7, n - steps):
        assert _sequential(runner, aux, ids, embeds, j, steps) == [int(chain[k][j]) for k in range(steps)], j


def test_acceptance_per_step_counts_only_what_serving_would_see(runner_and_chunk):
    """Step k at position j counts where steps 1..k-1 predicted the target's tokens and the prompt went on with
    them; a hand count over the same chains gives the same numbers."""
    from eagle3_ops.doctor import replay
    from eagle3_ops.doctor.search import chunks

    runner, _, states, _ = runner_and_chunk
    got = replay.chain_acceptance(runner, states, [3, 5, 7], 3, 96)
    seen, accepted = [0, 0, 0], [0, 0, 0]
    for c in chunks(states, 96, runner.uses_target_embeddings):
        aux = torch.cat([c.bounds[b] for b in (3, 5, 7)], dim=-1)
        for row in range(c.ids.shape[0]):
            chain = runner.chain(aux[row:row + 1], c.ids[row:row + 1],
                                 c.embeds[row:row + 1] if c.embeds is not None else None, 3)
            ids, labels = c.ids[row].tolist(), c.labels[row].tolist()
            for j in range(len(ids)):
                for k in range(1, 4):
                    if j > len(ids) - k:
                        break
                    prior = all(int(chain[i - 1][j]) == labels[j + i - 1] and ids[j + i] == labels[j + i - 1]
                                for i in range(1, k))
                    if prior:
                        seen[k - 1] += 1
                        accepted[k - 1] += int(chain[k - 1][j]) == labels[j + k - 1]
    assert got["positions"] == seen and got["accepted"] == accepted
    assert got["per_step"][0] == accepted[0] / seen[0]


def test_doctor_replay_steps_writes_the_chain(runner_and_chunk, pair):
    from doctor_fixtures import run_doctor

    _, _, _, states_file = runner_and_chunk
    rc, rep, err = run_doctor("--draft", str(pair.draft_dir), "--target", str(pair.target_dir), "--replay",
                              str(states_file), "--replay-steps", "2", "--replay-max-tokens", "128")
    chain = rep["replay"]["chain"]
    assert chain["steps"] == 2 and len(chain["positions"]) == 2 and chain["positions"][0] >= 128, json.dumps(chain)
    assert chain["per_step"][0] == pytest.approx(rep["replay"]["configured"]["accuracy"])


def test_the_later_steps_keep_to_a_time_budget_and_the_live_check_asks_for_the_servers_steps(runner_and_chunk,
                                                                                             monkeypatch, tmp_path):
    """The live check's replay child has one wall-clock bound for everything: the later steps stop at their budget
    and say so (the verdict before them is kept). The live check asks for as many steps as the server drafts."""
    import types

    from eagle3_ops.doctor import replay
    from eagle3_ops.sglang import dump_states, wiring_check

    runner, _, states, _ = runner_and_chunk
    got = replay.chain_acceptance(runner, states, [3, 5, 7], 3, 96, time_budget_s=0.0)
    assert got["positions"] == [0, 0, 0] and "time budget of 0 s ran out" in got["stopped"]
    check = wiring_check.WiringCheck("LlamaForCausalLM", tmp_path, {}, [3, 5, 7], 8, 0, 1)
    assert "--replay-steps" not in check.command(tmp_path / "s", tmp_path / "t")  # no server: the first step only
    monkeypatch.setattr(dump_states, "server_args", lambda: types.SimpleNamespace(speculative_num_steps=3))
    cmd = check.command(tmp_path / "s", tmp_path / "t")
    assert cmd[cmd.index("--replay-steps") + 1] == "3"
