"""``voxpipe ask``: one audio file as a spoken turn against a running server."""

from __future__ import annotations

import asyncio
import json
import sys


def ask_command(args) -> int:
    """``voxpipe ask``: send one audio file as a turn, print (or ``--json``) what came back.
    Exit codes: 0 answered, 1 failed, 3 server unavailable, 4 no reply in time, EXIT_DENIED."""
    from websockets.exceptions import WebSocketException

    from clients.client import (
        EXIT_DENIED,
        AccessDenied,
        ServerUnavailable,
        ask,
        describe_busy,
        describe_status,
        save_reply,
    )

    try:
        live = None if args.json else (lambda p: print(f"  ... {p['text']}", flush=True))
        status = None if args.json else (lambda s: print(describe_status(s, column=12), flush=True))
        res = asyncio.run(ask(args.audio, url=args.url, fast=args.fast, timeout_s=args.timeout,
                              language=args.language, on_partial=live, on_status=status, token=args.token,
                              codec=args.codec))
    except AccessDenied as exc:
        print(f"voxpipe ask: {exc}", file=sys.stderr)
        return EXIT_DENIED
    except ServerUnavailable as exc:
        print(f"voxpipe ask: {exc}", file=sys.stderr)
        return 3
    except TimeoutError:
        print(f"voxpipe ask: no reply within {args.timeout:.0f} s", file=sys.stderr)
        return 4
    except (OSError, RuntimeError, WebSocketException) as exc:
        print(f"voxpipe ask: {exc}", file=sys.stderr)
        return 1
    if res.reply_audio and args.out:
        save_reply(res, args.out)
    if args.json:
        print(json.dumps(res.as_json()))
    else:
        print(f"you said:   {res.transcript or '(nothing)'}{f' [{res.language}]' if res.language else ''}")
        why = f" (turn.empty: {res.empty_reason})" if res.empty_reason and not res.reply_text else ""
        if res.text_only and res.reply_text:
            why = " (text only: speech unavailable)"
        said_by = f" [voice {res.voice}]" if res.voice and res.reply_text else ""
        print(f"voxpipe:    {res.reply_text or '(no reply)'}{why}{said_by}")
        if res.busy and not res.reply_text:
            retry_s = (res.busy.get("retry_after_ms") or 0) / 1000
            print(f"busy:       {describe_busy(res.busy)}; try again in {retry_s:.1f} s")
        if res.reply_audio:
            where = f"-> {args.out}" if args.out else "(not saved: --no-out)"
            print(f"reply audio {res.as_json()['reply_audio_s']:.2f} s {where}")
        print("timings ms: " + ", ".join(f"{k}={v}" for k, v in res.timings_ms.items()))
    for err in res.errors:
        print(f"server error {err.get('code')}: {err.get('message')}", file=sys.stderr)
    failed = any(e.get("fatal") for e in res.errors) or (res.errors and not res.reply_text and not res.busy)
    return 1 if failed else 0
