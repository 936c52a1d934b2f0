"""Token sources: how the bench builds prompts of a given length in tokens.

* ``local``: a Hugging Face ``tokenizer.json`` on this machine (exact, fast).
* ``server``: the server's ``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes).
* ``words``: no tokenizer at all; one word of a fixed list stands for one token, so lengths are
  only approximate (use it for servers without /tokenize).

Random prompts draw token ids from a *pool*: the ids of the fixed word list as the tokenizer
encodes it, so prompts are made of ordinary text pieces rather than control or byte tokens. Text
built from ids is re-encoded and trimmed/padded until it encodes to the wanted length (BPE may
merge across piece boundaries); with ``--token-ids`` a completions prompt is the id list itself,
exact by construction.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import httpx

from bench.client.words import WORDS

_FIXUP_ROUNDS = 4


class TokenSourceError(RuntimeError):
    pass


class TokenSource(ABC):
    name: str
    exact: bool  # can encode text, so text lengths can be checked and fixed

    @abstractmethod
    def decode(self, ids: list[int]) -> str: ...

    def encode(self, text: str) -> list[int]:
        raise TokenSourceError(f"the {self.name!r} token source cannot encode text")

    def describe(self) -> dict[str, Any]:
        return {"kind": self.name}

    def count(self, text: str) -> int:
        """How many tokens ``text`` is (a dataset's own text, e.g. a ShareGPT turn)."""
        return len(self.encode(text))

    def pool(self) -> list[int]:
        """Candidate ids for random prompts (sorted, unique)."""
        ids = sorted(set(self.encode(" " + " ".join(WORDS))))
        if not ids:
            raise TokenSourceError("the tokenizer encoded the word list to nothing")
        return ids

    def sample_ids(self, rng: random.Random, pool: list[int], n: int) -> list[int]:
        return [pool[rng.randrange(len(pool))] for _ in range(n)]

    def text_of_length(self, rng: random.Random, pool: list[int], n: int) -> str:
        """Text that encodes to ``n`` tokens where the source can check it, else ~``n`` tokens."""
        ids = self.sample_ids(rng, pool, n)
        text = self.decode(ids)
        if not self.exact:
            return text
        for _ in range(_FIXUP_ROUNDS):
            enc = self.encode(text)
            if len(enc) == n:
                break
            enc = enc[:n] if len(enc) > n else enc + self.sample_ids(rng, pool, n - len(enc))
            text = self.decode(enc)
        return text


class LocalTokenizer(TokenSource):
    name = "local"
    exact = True

    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer

        self.directory = Path(directory)
        path = self.directory / "tokenizer.json"
        if not path.is_file():
            raise TokenSourceError(f"{self.directory} has no tokenizer.json")
        self._tok = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.name, "path": str(self.directory.resolve())}


class ServerTokenizer(TokenSource):
    name = "server"
    exact = True

    def __init__(self, base_url: str, model: str, headers: dict[str, str], timeout: float = 30.0) -> None:
        self.base_url = base_url
        self.model = model
        # No proxy from the environment: the requests themselves never take one (request.py), and
        # a proxy that cannot reach the server would quietly turn 'auto' into approximate words.
        self._client = httpx.Client(headers=headers, timeout=timeout, trust_env=False)

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            resp = self._client.post(self.base_url + path, json={"model": self.model, **body})
        except httpx.HTTPError as exc:
            raise TokenSourceError(f"POST {path} failed: {exc}") from None
        if resp.status_code != 200:
            raise TokenSourceError(f"POST {path} answered {resp.status_code}: {resp.text[:200]}")
        try:
            body = resp.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise TokenSourceError(f"POST {path} answered 200 without a JSON object: {resp.text[:200]!r}")
        return body

    def encode(self, text: str) -> list[int]:
        tokens = self._post("/tokenize", {"prompt": text, "add_special_tokens": False}).get("tokens")
        if not isinstance(tokens, list):
            raise TokenSourceError("POST /tokenize answered without a 'tokens' list")
        return tokens

    def decode(self, ids: list[int]) -> str:
        text = self._post("/detokenize", {"tokens": ids}).get("prompt")
        if not isinstance(text, str):
            raise TokenSourceError("POST /detokenize answered without a 'prompt' string")
        return text

    def describe(self) -> dict[str, Any]:
        return {"kind": self.name, "url": self.base_url}

    def close(self) -> None:
        self._client.close()


class WordSource(TokenSource):
    name = "words"
    exact = False

    def pool(self) -> list[int]:
        return list(range(len(WORDS)))

    def decode(self, ids: list[int]) -> str:
        return " ".join(WORDS[i] for i in ids)

    def count(self, text: str) -> int:
        return len(text.split())  # a word stands for a token, as in the prompts built here


def make_token_source(
    spec: str, base_url: str, model: str, model_arg: str | None, headers: dict[str, str]
) -> TokenSource:
    """Resolve ``--tokenizer``: a directory, 'server', 'words', or 'auto'."""
    if spec == "words":
        return WordSource()
    if spec == "server":
        return ServerTokenizer(base_url, model, headers)
    if spec != "auto":
        return LocalTokenizer(spec)
    if model_arg and (Path(model_arg) / "tokenizer.json").is_file():
        return LocalTokenizer(model_arg)
    server = ServerTokenizer(base_url, model, headers)
    try:
        server.encode("probe")
        return server
    except TokenSourceError:
        server.close()
        return WordSource()
