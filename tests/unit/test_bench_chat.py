"""benchmarks/bench_chat.py runs its whole code path on CPU with the tiny Qwen3 (the GPU run differs only in
the model's size and dtype): each prompt answered to its full length, time to first token and tokens/s recorded."""

import json

import pytest

pytestmark = pytest.mark.slow


def test_bench_chat_on_cpu(tmp_path):
    from benchmarks import bench_chat

    out = tmp_path / "chat.json"
    result = bench_chat.main(["--tiny", "--device", "cpu", "--prompts", "3", "--prompt-tokens", "40",
                              "--max-new-tokens", "6", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert [a["tokens"] for a in result["answers"]] == [6, 6, 6]
    assert all(a["prompt_tokens"] >= 40 and a["ttft_s"] > 0 and a["tokens_per_s"] > 0 for a in result["answers"])
    assert result["later_ttft_max_s"] == max(a["ttft_s"] for a in result["answers"][1:])
    assert result["dtype"] == "float32" and result["gpu"] == "cpu" and result["lora_r"] == 16


def test_one_prompt_is_refused(capsys):
    from benchmarks import bench_chat

    with pytest.raises(SystemExit):
        bench_chat.main(["--tiny", "--device", "cpu", "--prompts", "1"])
    assert "--prompts must be at least 2" in capsys.readouterr().err
