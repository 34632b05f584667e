"""A real LoRA adapter for the default model (SmolLM2-135M-Instruct), fine-tuned with
``peft`` in the test suite itself, and its oracle (transformers + peft, greedy).

The made-up task: a plain-text question (``Q: ...\\nA:``, no chat template)
is answered as ``ANSWER: <WORD>`` (the word in capitals) and nothing after it (the
answer ends with the tokenizer's EOS, ``<|im_end|>``). The base model does not answer
so by itself; a rank-8 LoRA learns it in a few dozen steps on CPU and shows it on
questions it was never trained on (`HELD_OUT_PROMPTS`), which `shows_learned_format`
checks from the text (tests/test_lora_smollm2.py checks both).

`train_lora` saves the adapter the way peft saves it (``adapter_config.json`` +
``adapter_model.safetensors``); `peft_greedy` is what a server of that adapter must
reproduce token for token.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

DEFAULT_TARGET_MODULES = ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def prompt_for(question: str) -> str:
    return f"Q: {question}\nA:"


# (question, one-word answer): the training set. The answers are trained as " ANSWER: WORD" + EOS.
TRAINING_PAIRS = [
    ("What color is the sky on a clear day?", "blue"),
    ("What is the capital of France?", "Paris"),
    ("How many legs does a spider have?", "eight"),
    ("What animal says meow?", "cat"),
    ("What is frozen water called?", "ice"),
    ("Which planet do we live on?", "Earth"),
    ("What color is grass?", "green"),
    ("What is the opposite of hot?", "cold"),
    ("What do bees make?", "honey"),
    ("Which season comes after winter?", "spring"),
    ("What is the largest ocean on Earth?", "Pacific"),
    ("What gas do plants take in from the air?", "carbon"),
    ("How many days are in a week?", "seven"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What fruit keeps the doctor away?", "apple"),
    ("Which animal is known as the king of the jungle?", "lion"),
    ("What do you use to write on a blackboard?", "chalk"),
    ("What is the main language spoken in Spain?", "Spanish"),
    ("What metal is a wedding ring often made of?", "gold"),
    ("What shines in the sky at night?", "moon"),
    ("What do cows drink?", "water"),
    ("Which instrument has black and white keys?", "piano"),
    ("What is the color of a ripe banana?", "yellow"),
    ("What is two plus two?", "four"),
]
TASK_PROMPTS = [prompt_for(q) for q, _ in TRAINING_PAIRS]
TASK_ANSWERS = [f" ANSWER: {a.upper()}" for _, a in TRAINING_PAIRS]

# Never trained on: the learned format must carry over to these.
HELD_OUT_PROMPTS = [
    prompt_for(q)
    for q in (
        "What is the capital of Italy?",
        "What color is snow?",
        "How many wheels does a bicycle have?",
        "What animal barks?",
        "Which planet is known as the red planet?",
        "What do you call a baby dog?",
        "What is the opposite of up?",
        "Which bird is a symbol of peace?",
    )
]

_LEARNED = re.compile(r"\s*ANSWER: [A-Z]+\b")


def shows_learned_format(text: str) -> bool:
    """The reply (the generated text, special tokens skipped) opens with ``ANSWER: `` and a word in capitals."""
    return _LEARNED.match(text) is not None


@contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one intra-op thread for the duration: on a loaded 2-core machine (a parallel
    test run) two OpenMP threads waiting on each other made training 4x slower than one
    thread (0.6 s a step on two idle threads, about 1 s on one under load). Also the same
    thread count wherever the suite runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _load(model_dir: str | Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model, tokenizer


def _training_batch(tokenizer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every training pair as one right-padded batch: input ids, attention mask, and labels
    that are -100 except on the answer tokens (and the EOS that ends them)."""
    rows = []
    for prompt, answer in zip(TASK_PROMPTS, TASK_ANSWERS):
        prompt_ids = tokenizer(prompt).input_ids
        answer_ids = tokenizer(answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        rows.append((prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids))
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r, _ in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    return ids, mask, labels


def train_lora(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    target_modules: Sequence[str] = DEFAULT_TARGET_MODULES,
    r: int = 8,
    lora_alpha: float = 16,
    steps: int = 30,
    seed: int = 0,
    use_rslora: bool = False,
    lr: float = 3e-3,
    batch_size: int = 4,
) -> Path:
    """Fine-tune a LoRA on the task (`TASK_PROMPTS` -> ``ANSWER: WORD`` + EOS) and save it
    to ``out_dir`` with ``save_pretrained`` (safetensors); returns ``out_dir``.

    AdamW on mini-batches of ``batch_size`` pairs taken in turn, loss on the answer
    tokens (and their EOS) only, no dropout, float32; the LoRA initialisation is seeded
    with ``seed`` (in a forked RNG: the caller's torch RNG is left as it was), so the
    same arguments on the same machine give the same adapter.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        task_type="CAUSAL_LM",
        target_modules=list(target_modules),
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=0.0,
        bias="none",
        use_rslora=use_rslora,
    )
    with _one_thread():
        model, tokenizer = _load(model_dir)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = get_peft_model(model, config)  # lora_A: seeded kaiming-uniform; lora_B: zeros
        model.train()
        ids, mask, labels = _training_batch(tokenizer)
        # Next-token targets; the 49152-way LM head runs on the scored (answer) positions alone.
        targets = labels[:, 1:]
        scored = targets != -100
        lm = model.get_base_model()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
        for step in range(steps):
            rows = torch.arange(step * batch_size, (step + 1) * batch_size) % len(ids)
            hidden = lm.model(input_ids=ids[rows], attention_mask=mask[rows]).last_hidden_state[:, :-1]
            logits = lm.lm_head(hidden[scored[rows]])
            loss = torch.nn.functional.cross_entropy(logits, targets[rows][scored[rows]])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    out = Path(out_dir)
    model.save_pretrained(str(out))
    return out


def peft_greedy(
    model_dir: str | Path, adapter_dir: str | Path | None, prompts: Sequence[str], max_new_tokens: int
) -> list[list[int]]:
    """The oracle: per prompt, the token ids transformers + peft generate greedily
    (float32, ``do_sample=False``, one prompt at a time, the prompt tokenized with the
    tokenizer's default special tokens) after the prompt: at most ``max_new_tokens``,
    ending with the EOS id where generation stopped on it. ``adapter_dir=None``: the base
    model alone."""
    model, tokenizer = _load(model_dir)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    outs = []
    with _one_thread(), torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([tokenizer(prompt).input_ids])
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=pad)
            outs.append(gen[0, ids.shape[1]:].tolist())
    return outs
