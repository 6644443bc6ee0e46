"""A first look at an SDP offer (RFC 8866, JSEP's offer of RFC 8829), before the WebRTC stack
sees it: what voxpipe needs is there and whole, or one sentence says what is not.

aiortc parses a cut or mangled offer into ``AssertionError``, ``KeyError`` or
``'NoneType' object has no attribute 'role'``; a client deserves "the data channel section has
no a=fingerprint line (truncated?)". Pure text checks, no aiortc: each media section (or the
session part above them) must carry the ICE credentials and a well-formed DTLS fingerprint and
role, and ICE credentials of a possible length; there must be an audio section offering Opus and
a data channel section; every line must be ``x=value`` and every candidate line whole. (A
missing final line break alone is not refused: some signalling code trims the text.)
"""

from __future__ import annotations

import http
import re
from dataclasses import dataclass, field

from .types import EVENTS_LABEL, OfferError

DIGEST_BYTES = {"sha-1": 20, "sha-224": 28, "sha-256": 32, "sha-384": 48, "sha-512": 64}
"""Fingerprint hash functions (RFC 8122 §5) and their digest sizes (bytes)."""
SETUP_ROLES = frozenset({"actpass", "active", "passive", "holdconn"})
"""The DTLS roles of ``a=setup`` (RFC 4145 §4)."""
_LINE = re.compile(r"^[a-z]=")
_HEX_PAIR = re.compile(r"^[0-9A-Fa-f]{2}$")


@dataclass
class _Section:
    """One part of the SDP: the session part (``kind`` ``session``) or a media section."""

    kind: str
    m_line: str = ""
    attrs: dict[str, list[str]] = field(default_factory=dict)

    def attr(self, name: str, session: _Section) -> list[str]:
        """Values of ``a=name`` here, else in the session part (where JSEP allows either)."""
        return self.attrs.get(name) or session.attrs.get(name, [])


def _what(section: _Section) -> str:
    return {"audio": "the audio section", "application": "the data channel section"}.get(
        section.kind, f"the {section.kind} section")


def _fail(why: str, *, cut: bool = True) -> OfferError:
    what = "the SDP offer is incomplete or malformed (truncated?)" if cut else "the SDP offer cannot be answered"
    return OfferError(http.HTTPStatus.BAD_REQUEST, f"{what}: {why}")


def _check_fingerprint(value: str, where: str) -> None:
    algo, _, digest = value.strip().partition(" ")
    size = DIGEST_BYTES.get(algo.lower())
    pairs = digest.strip().split(":")
    if size is None:
        raise _fail(f"{where} has a fingerprint with an unknown hash function {algo[:20]!r}")
    if len(pairs) != size or not all(_HEX_PAIR.match(p) for p in pairs):
        raise _fail(f"{where} has a cut or malformed {algo} fingerprint ({len(pairs)} of {size} bytes)")


def _check_candidate(value: str, where: str) -> None:
    parts = value.split()
    # foundation component transport priority address port "typ" type [...]
    if len(parts) < 8 or parts[6] != "typ" or not parts[1].isdigit() or not parts[5].isdigit():
        raise _fail(f"{where} has a cut or malformed candidate line ({value[:60]!r})")


def parse_sections(sdp: str) -> list[_Section]:
    """The session part and the media sections of ``sdp``, in order.

    Raises:
        OfferError: 400, a line that is not ``x=value`` or an ``m=`` line cut short.
    """
    lines = [ln for ln in sdp.replace("\r\n", "\n").split("\n") if ln.strip()]
    if not lines or lines[0].strip() != "v=0":
        raise _fail("it does not start with the line v=0")
    sections = [_Section("session")]
    for n, line in enumerate(lines, 1):
        if not _LINE.match(line):
            raise _fail(f"line {n} is not of the form x=value ({line[:40]!r})")
        if line.startswith("m="):
            parts = line[2:].split()
            if len(parts) < 4:
                raise _fail(f"line {n} is a media line cut short ({line[:40]!r})")
            sections.append(_Section(parts[0], line))
        elif line.startswith("a="):
            name, _, value = line[2:].partition(":")
            sections[-1].attrs.setdefault(name.strip(), []).append(value)
    return sections


def check_offer(sdp: str) -> None:
    """Check that ``sdp`` is an offer voxpipe can answer (see the module docstring). Each
    section is checked whole first, so a cut offer is called cut before anything is missed.

    Raises:
        OfferError: 400 with one sentence naming the first problem found.
    """
    cut = not sdp.endswith("\n")  # every SDP line ends with CRLF (RFC 8866 §5): a cut offer's last has none
    sections = parse_sections(sdp)
    session, media = sections[0], sections[1:]
    for s in media:
        where = _what(s)
        if s.kind == "audio" and not any(v.split(" ", 1)[-1].lower().startswith("opus/48000")
                                         for v in s.attrs.get("rtpmap", [])):
            raise _fail(f"{where} offers no Opus codec (a=rtpmap:... opus/48000/2)", cut=cut)
        if s.kind == "application" and not (s.attrs.get("sctp-port") or s.attrs.get("sctpmap")):
            raise _fail(f"{where} has no a=sctp-port line")
        for name in ("ice-ufrag", "ice-pwd", "fingerprint", "setup"):
            values = s.attr(name, session)
            if not values or not values[0].strip():
                raise _fail(f"{where} has no a={name} line")
        for value in s.attr("fingerprint", session):
            _check_fingerprint(value, where)
        if s.attr("setup", session)[0].strip() not in SETUP_ROLES:
            raise _fail(f"{where} has a cut or malformed a=setup line")
        ufrag, pwd = s.attr("ice-ufrag", session)[0].strip(), s.attr("ice-pwd", session)[0].strip()
        if not (4 <= len(ufrag) <= 256 and 22 <= len(pwd) <= 256):
            raise _fail(f"{where} has a cut or malformed ICE ufrag or password (RFC 8839: 4 and 22 characters "
                        "at least)")
        for value in s.attrs.get("candidate", []):
            _check_candidate(value, where)
    kinds = [s.kind for s in media]
    if "audio" not in kinds:
        raise _fail("it has no audio section (m=audio): add the microphone track (or a recvonly audio "
                    "transceiver) before creating the offer", cut=cut)
    if "application" not in kinds:
        raise _fail("it has no data channel section (m=application): create the data channel "
                    f"'{EVENTS_LABEL}' before creating the offer", cut=cut)
