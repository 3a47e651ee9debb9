"""Text and a tokenizer for the litgpt check, made here (no hub, no download).

``python make_data.py OUT`` writes ``OUT/data/*.txt`` (sentences from a small seeded grammar: litgpt's
``TextFiles`` takes the first file, in sorted order, for validation) and ``OUT/tokenizer/`` (a byte-level
BPE trained with ``tokenizers`` and saved as ``tokenizer.json`` and ``tokenizer_config.json``, the two
files ``litgpt/tokenizer.py`` reads) and ``OUT/instructions.json`` (the fine-tune runs' data, read by litgpt's
``JSON`` data module: a subject as the instruction, the rest of a sentence and one more as the output).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

VOCAB_SIZE = 512
FILES = 4
SENTENCES_PER_FILE = 3000
INSTRUCTIONS = 240

SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the teacher", "a small bird", "the farmer", "our team"]
VERBS = ["sees", "likes", "carries", "finds", "paints", "follows", "builds", "watches"]
OBJECTS = ["the red ball", "a green tree", "the long road", "a quiet house", "the river", "an apple", "the moon"]
ENDINGS = ["today", "every morning", "in the garden", "after dinner", "near the station", "with great care"]


def sentence(rng: random.Random) -> str:
    return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(ENDINGS)}."


def instructions(rng: random.Random) -> list[dict[str, str]]:
    """Short records (under 30 tokens with the BPE here: the check's model has a context of 64)."""
    return [{"instruction": rng.choice(SUBJECTS), "input": "",
             "output": f" {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(ENDINGS)}. {sentence(rng)}"}
            for _ in range(INSTRUCTIONS)]


def main(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    files = []
    for index in range(FILES):
        path = data / f"part{index}.txt"
        path.write_text("\n".join(sentence(rng) for _ in range(SENTENCES_PER_FILE)) + "\n", encoding="utf-8")
        files.append(str(path))

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train(files, trainer)
    directory = out / "tokenizer"
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    (out / "instructions.json").write_text(json.dumps(instructions(random.Random(1)), indent=1))
    print(f"{FILES} text files ({sum(Path(f).stat().st_size for f in files)} bytes) in {data}; "
          f"a {tokenizer.get_vocab_size()}-token BPE in {directory}; {INSTRUCTIONS} records in"
          f" {out / 'instructions.json'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
