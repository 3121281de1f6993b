"""The xgrammar grammar backend: compiles JSON schemas, regexes and EBNF grammars for the model's tokenizer and
fills the per-step allowed-token bitmask of each constrained request.

JSON is compiled without free whitespace (``any_whitespace=False``: one separator form, as ``json.dumps`` writes
it), so a constrained model cannot wander into endless whitespace: the grammar itself moves it towards the end.
"""
from __future__ import annotations

import json
import re
import threading
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import xgrammar as xgr

from tierlm.backends.base import GrammarBackend, GrammarCompileError, GrammarMatcher
from tierlm.backends.grammar.emptiness import unproductive_rules
from tierlm.backends.grammar.worker_pool import CompileWorkerPool

if TYPE_CHECKING:  # the runtime hands in the model's transformers tokenizer; xgrammar reads its vocabulary
    from transformers import PreTrainedTokenizerBase

_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")


def compiler_message(e: BaseException) -> str:
    """xgrammar's error without its C++ log prefix ("[12:00:00] /project/cpp/x.cc:94: ")."""
    return _LOG_PREFIX.sub("", str(e).strip()).strip() or type(e).__name__


# xgrammar 0.2.9's JSON string characters let through what is not JSON text: a string with minLength/maxLength
# takes raw control characters (U+0000..U+001F; json.loads refuses them), and every string takes UTF-8-encoded
# surrogates (ED A0..BF xx: invalid UTF-8, decoded as three U+FFFD, which breaks maxLength). Both classes are
# replaced by one that excludes them.
_STRING_CHAR_CLASSES = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\uD800-\uDFFF]'


def json_schema_grammar(schema: str) -> "xgr.Grammar":
    """The grammar of a JSON schema: compact separators, no free whitespace; strict (no properties or items the
    schema does not name) except for the bare {"type": "object"} of response_format json_object, which allows any
    object."""
    try:
        any_object = json.loads(schema) == {"type": "object"}
    except ValueError:
        any_object = False  # the compiler's message says what is wrong with it
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=not any_object)
    ebnf = str(grammar)
    fixed = ebnf
    for char_class in _STRING_CHAR_CLASSES:
        fixed = fixed.replace(char_class, _JSON_STRING_CHAR)
    return grammar if fixed == ebnf else xgr.Grammar.from_ebnf(fixed)


def structural_tag_grammar(text: str) -> "xgr.Grammar":
    """The grammar of an xgrammar structural tag (JSON text): its JSON-schema parts are generated as
    json_schema_grammar generates JSON (compact, strict, valid strings), not with xgrammar's free whitespace."""
    try:
        tag = json.loads(text)
    except ValueError as e:
        raise ValueError(f"the structural tag is not JSON: {e}") from None

    def compact(node: Any) -> Any:
        if isinstance(node, list):
            return [compact(v) for v in node]
        if not isinstance(node, dict):
            return node
        if node.get("type") == "json_schema" and node.get("style", "json") == "json":
            schema = node.get("json_schema")
            schema = {"type": "object"} if schema is True else schema
            return {"type": "grammar", "grammar": str(json_schema_grammar(json.dumps(schema)))}
        return {k: compact(v) for k, v in node.items()}

    return xgr.Grammar.from_structural_tag(json.dumps(compact(tag)))


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: "xgr.GrammarMatcher") -> None:
        self._m = matcher

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token: int) -> bool:
        return bool(self._m.accept_token(int(token)))

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


def compile_checked(compiler: "xgr.GrammarCompiler", kind: str, text: str) -> "xgr.CompiledGrammar":
    """Compile ``text`` (a grammar of ``kind``) and refuse, with GrammarCompileError, a grammar whose language is
    empty or that has a rule no text completes. Runs in the compile worker process (compile_worker.py)."""
    compiled = _compile(compiler, kind, text)
    dead = unproductive_rules(str(compiled.grammar)) or []
    if "root" in dead or not _allows_a_start(compiled):
        raise GrammarCompileError("no text matches this grammar (its language is empty, e.g. a rule that only "
                                  "refers to itself, or a schema whose required part nests forever), so no output "
                                  "could follow it")
    if dead:
        raise GrammarCompileError(f"no text matches the grammar's rule '{dead[0]}' (it only refers to itself or to "
                                  "rules that never end), so an output that enters it could never be completed")
    return compiled


def _compile(compiler: "xgr.GrammarCompiler", kind: str, text: str) -> "xgr.CompiledGrammar":
    try:
        if kind == "json_schema":
            return compiler.compile_grammar(json_schema_grammar(text))
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "ebnf":
            return compiler.compile_grammar(text)
        if kind == "structural_tag":
            return compiler.compile_grammar(structural_tag_grammar(text))
    except (RuntimeError, ValueError, TypeError) as e:
        raise GrammarCompileError(compiler_message(e)) from None
    raise GrammarCompileError(f"unknown grammar kind {kind!r}")


def _allows_a_start(compiled: "xgr.CompiledGrammar") -> bool:
    """Some token (or the stop token, for a grammar of the empty text) is allowed first."""
    vocab_size = compiled.tokenizer_info.vocab_size
    bitmask = np.full((1, (vocab_size + 31) // 32), -1, np.int32)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
    return bool(bitmask.any())


class XGrammarBackend(GrammarBackend):
    """Compiles in worker processes (worker_pool.py), which a compile past its time limit kills: xgrammar's native
    compile cannot be interrupted in a thread (xgrammar issue #298). A small compiled grammar comes back serialized
    and is rebuilt here; a large one, once the worker compiled it within the limit, is compiled again here (cheaper
    than xgrammar's JSON round trip of it). Matchers run in this process."""

    name = "xgrammar"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: Sequence[int],
                 max_threads: int = 2, workers: int = 2) -> None:
        """``tokenizer``: the model's transformers tokenizer; ``vocab_size``: the logits' width (ModelInfo.vocab_size,
        may exceed the tokenizer's: the extra ids are never allowed); ``stop_token_ids``: the ids that end a
        request (the grammar allows them only where the document is complete); ``workers``: compile processes,
        started when a compile needs one; ``max_threads``: xgrammar's threads in each."""
        self.vocab_size = int(vocab_size)
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                                 stop_token_ids=list(stop_token_ids) or None)
        # xgrammar's own cache stays off (in the workers): runtime/grammar keeps one keyed by the grammar text.
        self.workers = CompileWorkerPool(self.tokenizer_info.serialize_json(), size=workers, max_threads=max_threads)
        self._max_threads = max_threads
        self._compiler: xgr.GrammarCompiler | None = None  # for the large grammars a worker compiled in time
        self._compiler_lock = threading.Lock()

    def compile(self, kind: str, text: str, timeout_s: float | None = None) -> xgr.CompiledGrammar:
        data = self.workers.compile(kind, text, timeout_s)
        if data is not None:
            return xgr.CompiledGrammar.deserialize_json(data, self.tokenizer_info)
        # the same compile just finished in the worker within the limit and passed the checks (deterministic)
        return _compile(self._local_compiler(), kind, text)

    def _local_compiler(self) -> xgr.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=self._max_threads,
                                                     cache_enabled=False)
            return self._compiler

    def compiled_bytes(self, compiled: xgr.CompiledGrammar) -> int:
        return int(compiled.memory_size_bytes)

    def matcher(self, compiled: xgr.CompiledGrammar) -> GrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled))

    def close(self) -> None:
        self.workers.close()
