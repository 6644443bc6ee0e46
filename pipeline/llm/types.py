"""Messages of the LLM stage: what a session asks for (:class:`GenRequest`), what it gets
back (:class:`GenStats`, :class:`FinishReason`), and what the scheduler hands the model
runner (:class:`SchedRequest` with its :class:`SamplingParams`, :class:`StepPlan`). No torch here."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pipeline.config import LlmConfig
from pipeline.tools.types import ToolSpec


@dataclass(slots=True)
class GenRequest:
    """A chat completion request.

    Attributes:
        messages: chat messages ``[{"role": ..., "content": ...}]`` (system first).
        max_new_tokens: most tokens to generate (default: ``LlmConfig.max_new_tokens``).
        temperature: 0 = greedy (default); >0 samples.
        top_p: nucleus sampling mass when sampling.
        seed: seeds this request's own random generator when sampling (same seed,
            same reply, whatever else is in the batch).
        stop: strings that end the reply (not included in it).
        session: the session asking (its cached KV is released when it ends:
            :meth:`~pipeline.llm.engine.LlmEngine.end_session`); None: anonymous.
        priority: :data:`PRIORITY_VOICE` (0, the default: someone is waiting to hear the
            reply) or :data:`PRIORITY_TEXT` (1: a text API client). While the batch is full,
            waiting requests take free slots lowest priority first, then by arrival
            (:meth:`~pipeline.llm.scheduler.Scheduler.schedule`).
        tools: functions the model may call (the chat template's tool format, or Hermes'
            written into the prompt: :func:`~pipeline.tools.render.tool_prompt`); its calls
            come back in the text as ``<tool_call>{json}</tool_call>`` blocks
            (:class:`~pipeline.tools.reply.ToolReplyReader` splits them out).
        tool_choice: ``auto`` (the model decides), ``none`` (no tool offered), ``required``
            (some call: the reply is made to start with ``<tool_call>``) or a tool's name (that
            call); a forced start is part of the stream's text
            (:func:`~pipeline.tools.render.forced_prefix`).
    """

    messages: list[dict]
    max_new_tokens: int = LlmConfig().max_new_tokens
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    session: str | None = None
    priority: int = 0
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: str = "auto"


PRIORITY_VOICE = 0
"""A spoken turn's reply: a listener waits for its first audio (the latency SLO)."""
PRIORITY_TEXT = 1
"""A text API request (``/v1/chat/completions``): it yields batch slots to voice turns
while it is younger than ``SchedulerConfig.priority_age_ms``."""


class FinishReason(enum.StrEnum):
    """Why a request ended. A ``str``: ``str(reason)`` and JSON give the bare value
    (``"stop"``), as the wire protocol's ``finish_reason`` expects."""

    STOP = "stop"
    """An end-of-sequence token or a stop string."""
    LENGTH = "length"
    """``max_new_tokens`` reached."""
    ABORT = "abort"
    """The stream was aborted (or the engine stopped)."""
    ERROR = "error"
    """The request could not run, or a model step failed."""


@dataclass(slots=True)
class GenStats:
    """Per-request measurements: ``ttft_ms`` (submit → first token), ``tpot_ms`` (mean
    time per output token after the first), ``prompt_tokens``, ``output_tokens``,
    ``finish_reason`` (None until the stream ends)."""

    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: FinishReason | None = None


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling: ``temperature`` 0 = greedy; else temperature + top-p
    (nucleus, Holtzman et al. 2020) with a per-request ``seed``."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    @staticmethod
    def of(req: GenRequest) -> SamplingParams:
        """The sampling settings of a session's request."""
        return SamplingParams(req.temperature, req.top_p, req.seed)


class State(enum.Enum):
    """A :class:`SchedRequest`'s life: waiting for a slot, in the batch (prefilling or
    decoding), finished."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class SchedRequest:
    """One generation request as the scheduler sees it.

    Attributes:
        rid: unique id.
        prompt_ids: prompt token ids.
        max_new_tokens: most tokens to generate.
        eos_ids: token ids that end the request (not part of the output).
        arrival: ``time.monotonic()`` when added.
        owner: the session that sent it (its cached KV blocks are released when it ends).
        sampling: how the runner picks this request's tokens (default greedy).
        output_ids: generated tokens so far.
        state: where the request is (waiting, in the batch, finished).
        finish_reason: why it finished (None until then).
        num_computed: prompt tokens already prefilled (chunked prefill).
        prompt_len: the original prompt's length (0: ``len(prompt_ids)``; set once the
            request was preempted and its prompt extended with its output so far).
        priority: :attr:`GenRequest.priority` (lower joins the batch first).
    """

    rid: int
    prompt_ids: list[int]
    max_new_tokens: int
    eos_ids: frozenset[int] = frozenset()
    arrival: float = field(default_factory=time.monotonic)
    owner: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    output_ids: list[int] = field(default_factory=list)
    state: State = State.WAITING
    finish_reason: FinishReason | None = None
    num_computed: int = 0
    prompt_len: int = 0
    priority: int = 0

    @property
    def kv_tokens(self) -> int:
        """Worst-case KV-cache tokens this request can hold."""
        return (self.prompt_len or len(self.prompt_ids)) + self.max_new_tokens

    def preempt(self) -> None:
        """Back to waiting with nothing computed (vLLM's recompute preemption): its prompt
        becomes the original prompt + the tokens generated so far, so when it runs again
        its prefill rebuilds the KV it lost and the next sampled token continues the reply."""
        self.prompt_len = self.prompt_len or len(self.prompt_ids)
        self.prompt_ids = self.prompt_ids[: self.prompt_len] + self.output_ids
        self.num_computed = 0
        self.state = State.WAITING


@dataclass(slots=True)
class StepPlan:
    """What the model runner does in one step.

    Attributes:
        prefill: requests prefilling a chunk of their prompt (``spans``); those whose
            chunk ends the prompt sample a first token and join the decoding batch.
        spans: ``rid -> (start, end)`` prompt tokens each prefill request computes now.
        decode: running requests that decode one token.
        evict: ids of requests whose rows leave the batch before this step.
        wait_s: when nothing is planned, how long the engine may sleep before asking again.
    """

    prefill: list[SchedRequest] = field(default_factory=list)
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)
    decode: list[SchedRequest] = field(default_factory=list)
    evict: list[int] = field(default_factory=list)
    wait_s: float | None = None

    @property
    def empty(self) -> bool:
        return not (self.prefill or self.decode or self.evict)


OPENAI_PREFIX = "openai:"
"""``--llm openai:URL[#model]``: the LLM is a remote OpenAI-compatible server."""


class RemoteLlmError(RuntimeError):
    """A remote LLM server (``--llm openai:URL``) failed a request that had started: it
    could not be reached (connection refused or reset), did not answer within the timeout,
    or answered with an HTTP error. A stream raises it from iteration; the session reports
    an ``error`` event (``reply_failed``) and the LLM breaker counts it."""


class RemoteLlmUnavailable(RuntimeError):
    """At start-up, the remote LLM server could not be reached or named no model: the
    server does not start (``voxpipe serve`` prints the message and exits with status 2)."""


@dataclass(frozen=True, slots=True)
class RemoteLlmSpec:
    """Where a remote OpenAI-compatible LLM is: ``--llm openai:URL[#model]``.

    Attributes:
        base_url: the API root, e.g. ``http://127.0.0.1:8000/v1`` (what the ``openai``
            client calls ``base_url``: ``/chat/completions`` and ``/models`` are under it).
        model: the model name sent with every request; None: the first one ``GET /models``
            lists at start-up.
    """

    base_url: str
    model: str | None = None

    @staticmethod
    def is_remote(name: str) -> bool:
        """Whether an ``--llm`` value names a remote server (``openai:...``)."""
        return name.strip().startswith(OPENAI_PREFIX)

    @classmethod
    def parse(cls, text: str) -> RemoteLlmSpec:
        """Parse ``openai:URL[#model]``: URL is ``http(s)://HOST[:PORT][/PATH]``.

        Raises:
            ValueError: not ``openai:``, a scheme other than http/https, no host, a bad
                port, a query string, or an empty model after ``#``.
        """
        from urllib.parse import urlsplit

        text = text.strip()
        if not text.startswith(OPENAI_PREFIX):
            raise ValueError(f"--llm {text!r}: a remote LLM is openai:URL[#model]")
        url, hashed, model = text[len(OPENAI_PREFIX):].partition("#")
        hint = "expected openai:http(s)://HOST[:PORT]/v1[#MODEL], e.g. openai:http://127.0.0.1:8000/v1"
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - raises ValueError for a port that is not a number in 0..65535
        except ValueError as exc:
            raise ValueError(f"--llm {text!r}: bad URL ({exc}); {hint}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--llm {text!r}: bad URL (need http:// or https:// and a host); {hint}")
        if parts.query:
            raise ValueError(f"--llm {text!r}: bad URL (no query string: the API root only); {hint}")
        if hashed and not model.strip():
            raise ValueError(f"--llm {text!r}: empty model name after '#'; {hint}")
        return cls(base_url=url.rstrip("/"), model=model.strip() or None)
