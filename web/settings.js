// voxpipe browser demo, settings: what the person may choose of the session (system
// prompt, language, end of turn and eagerness, push-to-talk, reply audio rate, audio codec;
// docs/PROTOCOL.md `session.start`),
// kept in the browser's localStorage and applied by the next session.start.

const KEY = "voxpipe.settings";
export const DEFAULTS = { systemPrompt: "", language: "", pushToTalk: false, outputRate: "auto", endOfTurn: "",
                          eagerness: "", codec: "auto" };
const RATES = ["auto", "16000", "22050", "24000", "48000"];
const RULES = ["", "silence", "smart-turn"];
const EAGERNESS = ["", "auto", "low", "medium", "high"];
const CODECS = ["auto", "pcm"]; // auto: Opus both ways where the browser and server can (app.js), else PCM

export function loadSettings() {
  let saved = {};
  try {
    saved = JSON.parse(localStorage.getItem(KEY) || "{}") || {};
  } catch {
    saved = {}; // unreadable: the defaults
  }
  const s = { ...DEFAULTS, ...saved };
  if (!RATES.includes(String(s.outputRate))) s.outputRate = "auto";
  if (!RULES.includes(s.endOfTurn)) s.endOfTurn = "";
  if (!EAGERNESS.includes(s.eagerness)) s.eagerness = "";
  if (!CODECS.includes(s.codec)) s.codec = "auto";
  return s;
}

export function saveSettings(s) {
  try {
    localStorage.setItem(KEY, JSON.stringify(s));
    return true;
  } catch {
    return false; // storage off (private mode): the settings last as long as the page
  }
}

// The fields of session.start these settings give (only those not at their default, so a
// page with default settings declares exactly the audio formats; the codec's fields are
// app.js's, which knows what the browser and the server can do).
export function sessionFields(s, contextRate) {
  const f = {};
  f.output_sample_rate = s.outputRate === "auto" ? contextRate : Number(s.outputRate);
  if (s.systemPrompt.trim()) f.system_prompt = s.systemPrompt.trim();
  if (s.language.trim()) f.language = s.language.trim().toLowerCase();
  if (s.pushToTalk) f.vad = false;
  if (s.endOfTurn) f.end_of_turn = s.endOfTurn;
  if (s.eagerness) f.eagerness = s.eagerness;
  return f;
}

// Wire the settings form (#settings-form) to `settings`; `onSave(settings)` after each save.
export function bindSettingsForm(settings, onSave) {
  const form = document.getElementById("settings-form");
  const fields = {
    systemPrompt: form.elements["system-prompt"],
    language: form.elements.language,
    pushToTalk: form.elements["push-to-talk"],
    outputRate: form.elements["output-rate"],
    endOfTurn: form.elements["end-of-turn"],
    eagerness: form.elements.eagerness,
    codec: form.elements.codec,
  };
  const show = () => {
    fields.systemPrompt.value = settings.systemPrompt;
    fields.language.value = settings.language;
    fields.pushToTalk.checked = settings.pushToTalk;
    fields.outputRate.value = String(settings.outputRate);
    fields.endOfTurn.value = settings.endOfTurn;
    fields.eagerness.value = settings.eagerness;
    fields.codec.value = settings.codec;
  };
  show();
  form.onsubmit = (e) => {
    e.preventDefault();
    const lang = fields.language.value.trim().toLowerCase();
    if (lang && !/^[A-Za-z]{2,3}([-_][A-Za-z0-9]{2,4})?$/.test(lang)) {
      form.querySelector(".saved").textContent = "language: an ISO code such as en, de, fr (or empty: detect)";
      return;
    }
    settings.systemPrompt = fields.systemPrompt.value.slice(0, 8000);
    settings.language = lang;
    fields.language.value = lang;
    settings.pushToTalk = fields.pushToTalk.checked;
    settings.outputRate = fields.outputRate.value;
    settings.endOfTurn = fields.endOfTurn.value;
    settings.eagerness = fields.eagerness.value;
    settings.codec = fields.codec.value;
    const kept = saveSettings(settings);
    form.querySelector(".saved").textContent = kept ? "saved" : "saved for this page only (storage is off)";
    onSave(settings);
  };
  form.onreset = (e) => {
    e.preventDefault();
    Object.assign(settings, DEFAULTS);
    show();
    saveSettings(settings);
    form.querySelector(".saved").textContent = "defaults restored";
    onSave(settings);
  };
}
