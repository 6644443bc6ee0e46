"""The turn state machine with scripted event sequences."""

from pipeline.session.turn_state import Phase, TurnState


def test_normal_turn_cycle():
    t = TurnState()
    assert t.speech_started() is Phase.USER_SPEAKING
    assert t.speech_stopped(turn_submitted=True) is Phase.THINKING
    assert t.reply_started() is Phase.THINKING
    assert t.audio_started() is Phase.SPEAKING
    assert t.reply_ended() is Phase.LISTENING


def test_cough_during_reply_is_only_a_candidate():
    t = TurnState()
    t.speech_started()
    t.speech_stopped(turn_submitted=True)
    t.reply_started()
    t.audio_started()
    assert t.speech_started() is Phase.USER_SPEAKING and t.interrupting
    assert t.speech_stopped(turn_submitted=False) is Phase.SPEAKING  # no words: reply goes on
    assert not t.interrupting and t.replying


def test_confirmed_barge_in_cancels_reply():
    t = TurnState()
    t.speech_started()
    t.speech_stopped(turn_submitted=True)
    t.reply_started()
    t.speech_started()
    assert t.interrupting
    assert t.barge_in() is Phase.USER_SPEAKING and not t.replying
    assert t.speech_stopped(turn_submitted=True) is Phase.THINKING


def test_reply_ending_while_user_speaks_keeps_user_speaking():
    t = TurnState()
    t.speech_started()
    t.speech_stopped(turn_submitted=True)
    t.reply_started()
    t.audio_started()
    t.speech_started()
    assert t.reply_ended() is Phase.USER_SPEAKING


def test_empty_turn_returns_to_listening():
    t = TurnState()
    t.speech_started()
    t.speech_stopped(turn_submitted=True)
    assert t.turn_empty() is Phase.LISTENING
