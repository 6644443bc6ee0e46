"""Phone calls through Twilio Media Streams: ``/twilio`` (docs/TWILIO.md)."""
