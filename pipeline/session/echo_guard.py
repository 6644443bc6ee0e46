"""The last guard against the assistant's own voice (pure, no I/O).

A client without headphones whose echo canceller has not converged (the first reply of a
session, a loud speaker) sends the reply's audio back as speech. The ASR then hears the
assistant's words over its own reply, which would cancel it or be added to the user's turn.
Speech whose words are, nearly all and in order, the words the reply was playing while that
speech was heard is the reply's echo: it neither cancels the reply nor continues or makes a
turn (``turn.empty`` ``echo``).

A person who repeats the assistant's words while it says them is taken for its echo too;
it takes :data:`ECHO_MIN_WORDS` words and :data:`ECHO_MATCH` of them, so a one-word "no"
or "Tuesday?" always counts as the user's.
"""

from __future__ import annotations

from difflib import SequenceMatcher

from pipeline.session.backchannel import words

ECHO_MIN_WORDS = 2
"""Fewer heard words are never taken for echo (a lone word is the user's, or a backchannel)."""

ECHO_MATCH = 0.8
"""The share of the heard words that must be found, in order, among the words played (the
ASR mishears a word of leaked speech now and then)."""

USER_RUN = 3
"""This many heard words in a row that the reply was not playing are the user's, however many
of the others are the reply's: a person talking over a faint echo that the client sent
with their voice ("I'm sure you're right. I'm sure you can do the country. I'm sure you're
right." over a reply repeating "I'm sure you're right.", ``voxpipe bench echo`` at -35 dB).
The ASR mishears an echo a word at a time."""

ECHO_LAG_S = 1.5
"""How long before the speech heard began its echo may have been played (s): the client's
output buffer and device latency, the path back through the microphone, and the VAD's
minimum speech before the speech is seen."""


def is_echo(heard: str, played: str) -> bool:
    """True when ``heard`` (a transcript of speech over a reply) is the echo of ``played``
    (the reply's text that was playing meanwhile): at least :data:`ECHO_MIN_WORDS` words, and
    at least :data:`ECHO_MATCH` of them matched in order within ``played``, and never
    :data:`USER_RUN` unmatched in a row (words normalized
    by :func:`~pipeline.session.backchannel.words`; matching blocks of :class:`difflib.SequenceMatcher`)."""
    h, p = words(heard), words(played)
    if len(h) < ECHO_MIN_WORDS or not p:
        return False
    blocks = SequenceMatcher(None, h, p, autojunk=False).get_matching_blocks()
    ends = [0] + [b.a + b.size for b in blocks[:-1]]  # each block's start minus the last one's end: unmatched runs
    if any(b.a - end >= USER_RUN for b, end in zip(blocks, ends, strict=True)):
        return False
    return sum(block.size for block in blocks) >= ECHO_MATCH * len(h)
