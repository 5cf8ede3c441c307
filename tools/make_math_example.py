"""Build the math example: a small random-init model shaped like a Qwen2 chat checkpoint, and a small
math word-problem dataset. Nothing is downloaded; the same seed gives the same files.

    python tools/make_math_example.py OUT_DIR [--seed 0] [--tool-warmup STEPS]

writes OUT_DIR/model (config.json, model.safetensors, generation_config.json and a byte-level BPE
tokenizer trained here with `tokenizers`: no BOS, `<|im_start|>`/`<|im_end|>` ChatML chat template,
`<|endoftext|>` pad, tied embeddings; the template shows `tools` and renders `tool` messages
the way Qwen 2.5's does) and OUT_DIR/data/{train,eval}.jsonl (`question`, `answer`).
The problems are one-step additions and subtractions in words with answers 0..`max_answer`, so a
2-layer model trained from random init with a math-verify reward learns some of them on 2 CPU cores.

`--answer-warmup STEPS` (`answer_warmup`) fine-tunes the model on direct answers to fresh problems (none of
them an eval question), the shape of a real checkpoint: one that already reads the question and answers
some of it right. A random-init model under RL learns only the commonest answer ("0", 18 % of the eval
split) and stays there (README "Learning defaults"); 300 steps of 16 here give it 58 % instead (800 steps:
every eval answer right, so supervised, this model learns the task from ~13k examples).

`--tool-warmup STEPS` (`tool_warmup`) then fine-tunes the model briefly on calculator transcripts
(question -> `<tool_call>` -> tool result -> answer, rendered by its chat template with the calculator
tool shown), so that its sampled turns are mostly well-formed tool calls (configs/agent-tools.toml).
A random-init model never writes one, and a tool run would never see a tool result.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML with tools the way Qwen 2.5 shows them (Hermes style): with `tools`, the system turn lists them
# (after the conversation's own system message) with how to call them, the same text as
# stages.environments.tool_calls.tools_prompt; an assistant's `tool_calls` follow its content as
# <tool_call> blocks; consecutive `tool` messages share one user turn, each in <tool_response> tags.
TOOLS_SYSTEM = (
    "# Tools\n\nYou may call the tools below to help with the task. Their signatures, one JSON object per line, "
    "are inside <tools></tools>:\n<tools>{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools>\n\n"
    "To call a tool, write a JSON object with its name and arguments inside tool-call tags:\n<tool_call>\n"
    '{"name": <tool name>, "arguments": <arguments as a JSON object>}\n</tool_call>'
)
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}" + TOOLS_SYSTEM + "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and loop.first and tools %}"
    "{% elif m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] %}<|im_start|>assistant\n{{ m['content'] or '' }}"
    "{% for c in m['tool_calls'] %}{% set f = c['function'] if c['function'] is defined else c %}"
    "{% if m['content'] or not loop.first %}{{ '\\n' }}{% endif %}<tool_call>\n{\"name\": {{ f['name'] | tojson }}, "
    "\"arguments\": {% if f['arguments'] is string %}{{ f['arguments'] }}{% else %}{{ f['arguments'] | tojson }}"
    "{% endif %}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
NAMES = ["Ann", "Ben", "Cara", "Dan", "Eve", "Finn", "Gia", "Hugo", "Ivy", "Jon"]
ITEMS = ["apple", "pen", "book", "coin", "shell", "card", "cup", "ball"]
TEMPLATES = [  # (question, operation)
    ("{name} has {a} {item}s and gets {b} more. How many {item}s does {name} have now?", "+"),
    ("There are {a} {item}s in a box. {name} puts in {b} more. How many {item}s are in the box?", "+"),
    ("{name} has {a} {item}s and gives {b} away. How many {item}s does {name} have left?", "-"),
    ("A shelf holds {a} {item}s. {name} takes {b} of them. How many {item}s stay on the shelf?", "-"),
]


def word_problem(rng: random.Random, max_answer: int) -> dict[str, str]:
    """One problem: `question` in words, `answer` the number as text (0 <= answer <= max_answer)."""
    template, op = rng.choice(TEMPLATES)
    if op == "+":
        answer = rng.randint(0, max_answer)
        a = rng.randint(0, answer)
        b = answer - a
    else:
        a = rng.randint(0, max_answer)
        b = rng.randint(0, a)
        answer = a - b
    question = template.format(name=rng.choice(NAMES), item=rng.choice(ITEMS), a=a, b=b)
    return {"question": question, "answer": str(answer)}


def make_math_data(folder: str | Path, *, train: int = 2000, eval: int = 200, max_answer: int = 9,
                   seed: int = 0) -> tuple[Path, Path]:
    """Write `train.jsonl` and `eval.jsonl` into `folder` (no eval question is a train question)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    train_rows = [word_problem(rng, max_answer) for _ in range(train)]
    seen = {row["question"] for row in train_rows}
    eval_rows: list[dict[str, str]] = []
    for _ in range(100 * eval):
        if len(eval_rows) == eval:
            break
        row = word_problem(rng, max_answer)
        if row["question"] not in seen:
            seen.add(row["question"])
            eval_rows.append(row)
    paths = folder / "train.jsonl", folder / "eval.jsonl"
    for path, rows in zip(paths, (train_rows, eval_rows), strict=True):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return paths


def _corpus(rng: random.Random, lines: int) -> list[str]:
    """Text the tokenizer is trained on: chat-formatted problems with their answers."""
    out = []
    for _ in range(lines):
        row = word_problem(rng, 99)
        out.append(f"<|im_start|>user\n{row['question']}<|im_end|>\n<|im_start|>assistant\n{row['answer']}<|im_end|>\n")
    return out


def make_tokenizer(vocab_size: int = 1024, seed: int = 0):
    """A byte-level BPE tokenizer trained on generated text, wrapped for transformers: no BOS, EOS
    `<|im_end|>`, pad `<|endoftext|>`, the ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(random.Random(seed), 3000), trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = CHAT_TEMPLATE
    return hf


def make_qwen_like_model(folder: str | Path, *, vocab_size: int = 1024, hidden_size: int = 96, layers: int = 2,
                         heads: int = 4, kv_heads: int = 2, seed: int = 0, max_positions: int = 512) -> Path:
    """Write a random-init Qwen2ForCausalLM with tied embeddings, its tokenizer and generation config; its context
    is `max_positions` (a server engine refuses a prompt beyond it: a tool prompt alone is ~660 tokens here)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(vocab_size, seed)
    tokenizer.save_pretrained(folder)
    im_end, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen2Config(
        vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=True, bos_token_id=None, eos_token_id=im_end,
        pad_token_id=pad,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        Qwen2ForCausalLM(config).save_pretrained(folder)
    GenerationConfig(eos_token_id=[im_end, pad], pad_token_id=pad, bos_token_id=None).save_pretrained(folder)
    return folder


ANSWER_SYSTEM_PROMPT = "Answer with a number."  # configs/math.toml's task.system_prompt
WARMUP_POSITIONS = 2048  # a tool prompt alone is ~660 tokens of this tokenizer; an episode grows per turn


def tool_transcript(row: dict[str, str]) -> list[dict]:
    """A calculator conversation for one problem of `word_problem`: the calculator's system prompt, the
    question, a call to add or subtract the problem's two numbers, its result, the answer."""
    from stages.environments.calculator import SYSTEM_PROMPT

    a, b = re.findall(r"\d+", row["question"])
    expression = f"{a} + {b}" if int(a) + int(b) == int(row["answer"]) else f"{a} - {b}"
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": row["question"]},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": row["answer"]},
            {"role": "assistant", "content": row["answer"]}]


def transcript_ids(renderer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of a transcript built the way a tool episode's record is (prompt, then each
    assistant turn and its stop token, then each reply rendered alone): 1 on the assistant's ids."""
    from stages.environments.calculator import CALCULATOR
    from stages.environments.tool_calls import render_turn

    ids = renderer.prompt_ids(messages[:2], [CALCULATOR])
    mask = [0] * len(ids)
    for message in messages[2:]:
        if message["role"] == "assistant":
            calls = [_tool_call(c) for c in message.get("tool_calls") or []]
            text = render_turn(message["content"], calls)
            turn = renderer.tokenizer.encode(text, add_special_tokens=False) + [renderer.stop_ids[0]]
        else:
            turn = renderer.reply_ids([message], after_stop=True)
        ids += turn
        mask += [int(message["role"] == "assistant")] * len(turn)
    return ids, mask


def _tool_call(call: dict):
    from stages.environments.base import ToolCall

    return ToolCall(call["name"], call["arguments"])


def tool_warmup(folder: str | Path, steps: int = 150, *, batch: int = 4, lr: float = 1e-2, seed: int = 0) -> float:
    """Fine-tune the model in `folder` in place on calculator transcripts (`tool_transcript`) for
    `steps` steps of `batch` transcripts, loss on the assistant's tokens only; returns the seconds taken.

    Every transcript starts with the same system prompt (the tools), so each step encodes it once,
    without gradient, and trains the rest of each transcript on that cache. One torch thread; the
    model's positions grow to `WARMUP_POSITIONS` (RoPE: no weights change) to hold whole episodes."""

    def transcripts(renderer, rng: random.Random) -> list[tuple[list[int], list[int]]]:
        return [transcript_ids(renderer, tool_transcript(word_problem(rng, 9))) for _ in range(256)]

    return _fine_tune(folder, transcripts, steps, batch, lr, seed, positions=WARMUP_POSITIONS)


def answer_warmup(folder: str | Path, steps: int = 300, *, eval_path: str | Path | None = None, batch: int = 16,
                  lr: float = 1e-3, seed: int = 7) -> float:
    """Fine-tune the model in `folder` in place on 1,024 fresh problems answered directly (system prompt
    "Answer with a number.", the math config's), loss on the answer and its stop token; questions that
    appear in `eval_path` are left out. Returns the seconds taken."""
    lines = Path(eval_path).read_text().splitlines() if eval_path else []
    held_out = {json.loads(line)["question"] for line in lines}

    def answers(renderer, rng: random.Random) -> list[tuple[list[int], list[int]]]:
        data = []
        while len(data) < 1024:
            row = word_problem(rng, 9)
            if row["question"] not in held_out:
                data.append(_answer_ids(renderer, row))
        return data

    return _fine_tune(folder, answers, steps, batch, lr, seed)


def _fine_tune(folder: str | Path, make_data, steps: int, batch: int, lr: float, seed: int,
               positions: int | None = None) -> float:
    """Load the model in `folder`, train it on `make_data(renderer, rng)` (`_train`, one torch thread,
    seeded), grow its positions to at least `positions`, save it in place; returns the seconds taken."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from stages.environments.render import ChatRenderer

    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32)
        rng = random.Random(seed)
        data = make_data(ChatRenderer(tokenizer), rng)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            _train(model, data, _common_prefix([ids for ids, _ in data]), steps, batch, lr, rng)
        if positions:
            model.config.max_position_embeddings = max(model.config.max_position_embeddings, positions)
        model.save_pretrained(folder)
    finally:
        torch.set_num_threads(threads)
    return time.perf_counter() - started


def answer_prompt_ids(renderer, question: str) -> list[int]:
    """The math config's prompt for `question`: its system prompt and the question, chat-templated."""
    return renderer.prompt_ids([{"role": "system", "content": ANSWER_SYSTEM_PROMPT},
                                {"role": "user", "content": question}])


def _answer_ids(renderer, row: dict[str, str]) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of the math config's prompt for `row`, then its answer and the stop token."""
    prompt = answer_prompt_ids(renderer, row["question"])
    answer = renderer.tokenizer.encode(row["answer"], add_special_tokens=False) + [renderer.stop_ids[0]]
    return prompt + answer, [0] * len(prompt) + [1] * len(answer)


def _common_prefix(sequences: list[list[int]]) -> int:
    """How many leading ids all `sequences` share, less one (the tails then start with an id to predict from)."""
    first, n = sequences[0], 0
    while n < min(map(len, sequences)) and all(s[n] == first[n] for s in sequences):
        n += 1
    return n - 1


def _train(model, data: list[tuple[list[int], list[int]]], shared: int, steps: int, batch: int, lr: float,
           rng: random.Random) -> None:
    """AdamW steps on right-padded transcript tails after the shared prefix's no-grad KV cache."""
    import torch

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    prefix = torch.tensor([data[0][0][:shared]])
    pad = model.config.pad_token_id
    for step in range(steps):
        for group in optimizer.param_groups:  # a short ramp up, then linear decay to 0 (sharp at the end)
            group["lr"] = lr * min((step + 1) / 10, 1 - step / steps)
        rows = rng.sample(data, batch)
        width = max(len(ids) for ids, _ in rows) - shared
        ids = torch.full((batch, width), pad)
        labels = torch.full((batch, width), -100)
        for i, (row_ids, mask) in enumerate(rows):
            tail = torch.tensor(row_ids[shared:])
            ids[i, : len(tail)] = tail
            labels[i, : len(tail) - 1] = torch.where(torch.tensor(mask[shared + 1 :]) == 1, tail[1:], -100)
        with torch.no_grad():
            cache = model(prefix, use_cache=True).cache
        cache.batch_repeat_interleave(batch)
        logits = model(ids, cache=cache).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    model.eval()


def make_math_example(out: str | Path, seed: int = 0, tool_warmup_steps: int = 0,
                      answer_warmup_steps: int = 0, heads: int = 4, kv_heads: int = 2) -> tuple[Path, Path]:
    """OUT/model and OUT/data/{train,eval}.jsonl; returns (model folder, data folder). With
    `answer_warmup_steps`, the model is warm-started on direct answers (`answer_warmup`); with
    `tool_warmup_steps`, then on calculator transcripts (`tool_warmup`). `heads` / `kv_heads` over the hidden
    size 96 (3 / 1: head size 32, what vLLM's CPU attention takes)."""
    out = Path(out)
    model = make_qwen_like_model(out / "model", seed=seed, heads=heads, kv_heads=kv_heads)
    make_math_data(out / "data", seed=seed)
    if answer_warmup_steps:
        seconds = answer_warmup(model, answer_warmup_steps, eval_path=out / "data" / "eval.jsonl")
        print(f"answer warmup: {answer_warmup_steps} steps in {seconds:.1f} s")
    if tool_warmup_steps:
        seconds = tool_warmup(model, tool_warmup_steps, seed=seed)
        print(f"tool warmup: {tool_warmup_steps} steps in {seconds:.1f} s")
    return model, out / "data"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="folder to write model/ and data/ into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tool-warmup", type=int, default=0, metavar="STEPS",
                        help="fine-tune on calculator tool-call transcripts for STEPS steps (0: none)")
    parser.add_argument("--answer-warmup", type=int, default=0, metavar="STEPS",
                        help="fine-tune on direct answers to fresh problems, STEPS steps of 16 (0: none; 300: ~58 %%)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads over hidden size 96 (3: head size 32, "
                        "for vLLM on CPU)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (must divide --heads)")
    args = parser.parse_args(argv)
    model, data = make_math_example(args.out, args.seed, args.tool_warmup, args.answer_warmup, args.heads,
                                    args.kv_heads)
    print(f"model: {model}\ndata:  {data}/train.jsonl, {data}/eval.jsonl")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the warmup uses the repo's `stages`
    main()
