"""``session.update`` in, ``session.created`` / ``session.updated`` out: the Realtime
session object in both shapes (beta: flat ``input_audio_format``, ``turn_detection``;
GA: ``type: "realtime"``, ``audio.input`` / ``audio.output``), over voxpipe's settings."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pydantic import ValidationError

from pipeline.config import EAGERNESS, VoxpipeConfig
from pipeline.session.events import MAX_CLIENT_TOOLS, MAX_TEXT_CHARS, ClientTool

from .types import BETA_SESSION_KEYS, REALTIME_RATE, Dialect, RealtimeError, Settings

MODEL = "voxpipe"
"""The ``model`` the session object reports (whatever ``?model=`` the client asked for)."""


def dialect_of(session: dict[str, Any]) -> Dialect | None:
    """The dialect a ``session.update``'s ``session`` is written in: ``ga`` when it has
    ``type: "realtime"`` or ``audio``, ``beta`` when it has a beta-only key
    (:data:`~server.realtime.types.BETA_SESSION_KEYS`), None when it could be either
    (only ``instructions``)."""
    if session.get("type") == "realtime" or "audio" in session:
        return "ga"
    if BETA_SESSION_KEYS & session.keys():
        return "beta"
    return None


def read_update(session: dict[str, Any], current: Settings) -> Settings:
    """The settings after a ``session.update`` carrying ``session``; what it omits stays.

    Raises:
        RealtimeError: ``invalid_value`` for a format other than PCM16 24 kHz, a turn
            detection other than ``server_vad`` / ``semantic_vad`` / null (or an
            ``eagerness`` other than auto/low/medium/high), a transcription
            session (``type: "transcription"``), instructions that are not a string or
            longer than :data:`~pipeline.session.events.MAX_TEXT_CHARS`, ``tools`` that
            are not a list of at most :data:`~pipeline.session.events.MAX_CLIENT_TOOLS`
            function tools (``{type: "function", name, description, parameters}``; param:
            the first field at fault), a ``tool_choice`` other than ``auto`` / ``none`` /
            ``required`` / ``{type: "function", name}`` naming one of the tools, a ``voice``
            (beta ``session.voice``, GA ``session.audio.output.voice``) that is not a string
            (whether the server has that voice is checked by the session).
    """
    new = replace(current)
    kind = session.get("type")
    if kind not in (None, "realtime"):
        raise RealtimeError("invalid_value", f"session type {kind!r} is not supported: only 'realtime'",
                            param="session.type")
    if "instructions" in session:
        text = session["instructions"]
        if text is not None and (not isinstance(text, str) or len(text) > MAX_TEXT_CHARS):
            raise RealtimeError("invalid_value", f"instructions must be a string of at most {MAX_TEXT_CHARS} "
                                "characters", param="session.instructions")
        new.instructions = text or None  # "" clears: the server's default
    audio = session.get("audio") or {}
    if not isinstance(audio, dict):
        raise RealtimeError("invalid_value", "session.audio must be an object", param="session.audio")
    inp, outp = audio.get("input") or {}, audio.get("output") or {}
    for where, fmt in (("session.input_audio_format", session.get("input_audio_format")),
                       ("session.output_audio_format", session.get("output_audio_format")),
                       ("session.audio.input.format", inp.get("format") if isinstance(inp, dict) else None),
                       ("session.audio.output.format", outp.get("format") if isinstance(outp, dict) else None)):
        _check_format(where, fmt)
    for where, holder in (("session.turn_detection", session), ("session.audio.input.turn_detection", inp)):
        if isinstance(holder, dict) and "turn_detection" in holder:
            new.server_vad, new.end_of_turn, new.eagerness = _vad(where, holder["turn_detection"])
    for where, holder in (("session.voice", session), ("session.audio.output.voice", outp)):
        if isinstance(holder, dict) and "voice" in holder:
            new.voice = _voice(where, holder["voice"])
    if "tools" in session:
        new.tools = _tools(session["tools"])
    if "tool_choice" in session:
        new.tool_choice = session["tool_choice"] if session["tool_choice"] is not None else "auto"
    session_choice(new)  # checks it (against the tools now in force)
    return new


def _voice(where: str, voice: Any) -> str | None:
    """``voice`` as a name (null or ``""``: none, each reply's language picks)."""
    if voice is None or voice == "":
        return None
    if not isinstance(voice, str) or len(voice) > 200:
        raise RealtimeError("invalid_value", "voice must be a voice's name (GET /v1/voices lists them)", param=where)
    return voice


def _tools(tools: Any) -> tuple[ClientTool, ...]:
    """``session.tools`` → the client tools (validated; see :func:`read_update`)."""
    if tools is None:
        return ()
    if not isinstance(tools, list) or len(tools) > MAX_CLIENT_TOOLS:
        raise RealtimeError("invalid_value", f"tools must be a list of at most {MAX_CLIENT_TOOLS} function tools",
                            param="session.tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise RealtimeError("invalid_value", f"tools[{i}]: only function tools are supported, not {kind!r}",
                                param=f"session.tools[{i}]")
        try:
            given = {k: v for k, v in tool.items() if v is not None}  # null: the default, as OpenAI's
            out.append(ClientTool.model_validate({**given, "type": "function"}))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(map(str, first["loc"]))
            raise RealtimeError("invalid_value", f"tools[{i}].{where}: {first['msg']}",
                                param=f"session.tools[{i}].{where}") from None
    return tuple(out)


def session_choice(settings: Settings) -> str:
    """``settings.tool_choice`` as the session takes it
    (:attr:`~pipeline.session.tools.SessionTools.choice`): ``auto``, ``none``, ``required``
    or a tool's name (a bare name is taken too, as the beta API's string).

    Raises:
        RealtimeError: ``invalid_value`` (param ``session.tool_choice``): anything else, or a
            function that is not among ``settings.tools``.
    """
    choice = settings.tool_choice
    if choice in ("auto", "none", "required"):
        return str(choice)
    name = choice.get("name") if isinstance(choice, dict) and choice.get("type") == "function" else choice
    if not isinstance(name, str):
        raise RealtimeError("invalid_value", f"tool_choice {choice!r} is not supported: 'auto', 'none', 'required' "
                            "or {'type': 'function', 'name': ...}", param="session.tool_choice")
    if name not in {t.name for t in settings.tools}:
        raise RealtimeError("invalid_value", f"tool_choice names {name[:64]!r}, which is not among the session's "
                            "tools", param="session.tool_choice")
    return name


def _check_format(where: str, fmt: Any) -> None:
    if fmt is None or fmt == "pcm16":
        return
    if isinstance(fmt, dict) and fmt.get("type", "audio/pcm") == "audio/pcm" \
            and fmt.get("rate", REALTIME_RATE) == REALTIME_RATE:
        return
    raise RealtimeError("invalid_value", f"audio format {fmt!r} is not supported: only PCM16 at {REALTIME_RATE} Hz "
                        "('pcm16', or {'type': 'audio/pcm', 'rate': 24000})", param=where)


def _vad(where: str, td: Any) -> tuple[bool, Any, Any]:
    """``turn_detection`` → (VAD on, end of turn rule, eagerness): ``server_vad`` ends turns
    on silence, ``semantic_vad`` with the end-of-turn model and its ``eagerness``."""
    if td is None:
        return False, None, None
    if isinstance(td, dict) and td.get("type") == "server_vad":
        return True, "silence", None
    if isinstance(td, dict) and td.get("type") == "semantic_vad":
        eager = td.get("eagerness") or "auto"  # null: the default, as OpenAI's
        if eager not in EAGERNESS:
            raise RealtimeError("invalid_value", f"eagerness {eager!r} is not supported: {', '.join(EAGERNESS)}",
                                param=f"{where}.eagerness")
        return True, "smart-turn", eager
    raise RealtimeError("invalid_value", f"turn_detection {td!r} is not supported: server_vad, semantic_vad "
                        "or null", param=where)


def session_object(settings: Settings, cfg: VoxpipeConfig, session_id: str, prompt: str) -> dict[str, Any]:
    """The session as ``session.created`` / ``session.updated`` report it, in the
    connection's dialect. ``prompt``: the system prompt in force."""
    turn = cfg.turn
    semantic = (settings.end_of_turn or turn.end_of_turn) == "smart-turn"
    td: dict[str, Any] | None = (
        {"type": "semantic_vad", "eagerness": settings.eagerness or turn.eagerness, "create_response": True,
         "interrupt_response": True} if semantic else
        {"type": "server_vad", "silence_duration_ms": turn.end_silence_ms, "prefix_padding_ms": turn.pad_ms,
         "create_response": True, "interrupt_response": True})
    if not settings.server_vad:
        td = None
    tools = {"tools": [t.model_dump() for t in settings.tools], "tool_choice": settings.tool_choice}
    common = {"id": f"sess_{session_id}", "object": "realtime.session", "model": MODEL, "instructions": prompt}
    if settings.dialect == "beta":
        return {**common, "modalities": ["audio", "text"], "input_audio_format": "pcm16",
                "output_audio_format": "pcm16", "turn_detection": td, "voice": settings.voice,
                "input_audio_transcription": {"model": "whisper"}, **tools}
    pcm = {"type": "audio/pcm", "rate": REALTIME_RATE}
    return {"type": "realtime", **common, "output_modalities": ["audio"],
            "audio": {"input": {"format": pcm, "turn_detection": td, "transcription": {"model": "whisper"}},
                      "output": {"format": pcm, "voice": settings.voice}},
            **tools}
