"use strict";
// The playground: no framework, no build step, nothing loaded from anywhere but this service.

const RATE = 24000;
const $ = (id) => document.getElementById(id);
const keyStore = window.sessionStorage;

function authHeaders() {
  const key = keyStore.getItem("chattts-api-key");
  return key ? { Authorization: "Bearer " + key } : {};
}

function showMessage(text, kind) {
  const box = $("message");
  box.textContent = text;
  box.className = "message" + (kind === "info" ? " info" : "");
  box.hidden = !text;
}

function needKey(message) {
  $("key-row").hidden = false;
  showMessage(message || "This service needs an API key: enter it below.");
  $("api-key").focus();
}

async function errorText(response) {
  let detail = response.statusText;
  try {
    const body = await response.json();
    detail = typeof body.error === "string" ? body.error : body.error.message;
  } catch (ignored) { /* not JSON */ }
  if (response.status === 503) {
    const retry = response.headers.get("Retry-After");
    return `Busy (503): ${detail}.` + (retry ? ` Try again in ${retry} s.` : "");
  }
  return `${response.status}: ${detail}`;
}

function wavFile(pcmParts, samples) {
  const header = new DataView(new ArrayBuffer(44));
  const text = (offset, s) => [...s].forEach((c, i) => header.setUint8(offset + i, c.charCodeAt(0)));
  text(0, "RIFF"); header.setUint32(4, 36 + samples * 2, true); text(8, "WAVE");
  text(12, "fmt "); header.setUint32(16, 16, true); header.setUint16(20, 1, true);
  header.setUint16(22, 1, true); header.setUint32(24, RATE, true);
  header.setUint32(28, RATE * 2, true); header.setUint16(32, 2, true);
  header.setUint16(34, 16, true); text(36, "data"); header.setUint32(40, samples * 2, true);
  return new Blob([header, ...pcmParts], { type: "audio/wav" });
}

function showResult(result) {
  $("r-latency").textContent = result.latency.toFixed(2) + " s";
  $("r-first").textContent = result.first == null ? "–" : result.first.toFixed(2) + " s";
  $("r-audio").textContent = result.audio.toFixed(2) + " s";
  $("r-rtf").textContent = result.audio > 0 ? (result.latency / result.audio).toFixed(2) : "–";
  $("r-cache").textContent = result.cache || "–";
}

function setAudio(blob, extension) {
  const player = $("player");
  if (player.dataset.url) URL.revokeObjectURL(player.dataset.url);
  const url = URL.createObjectURL(blob);
  player.dataset.url = url;
  player.src = url;
  const link = $("download");
  link.href = url;
  link.download = "speech." + extension;
  link.hidden = false;
}

// Streamed: raw PCM chunks played through Web Audio as they arrive, then kept as a WAV.
async function speakStreamed(body, started) {
  const response = await fetch("/synthesize", {
    method: "POST", headers: { "Content-Type": "application/json", ...authHeaders() },
    body: JSON.stringify({ ...body, format: "pcm", stream: true }),
  });
  if (!response.ok) return response;
  let context = null;
  try { context = new AudioContext({ sampleRate: RATE }); } catch (ignored) { /* no audio out */ }
  let playAt = 0, samples = 0, first = null, carry = null;
  const parts = [];
  const reader = response.body.getReader();
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    let bytes = value;
    if (carry) { bytes = new Uint8Array([carry, ...value]); carry = null; }
    if (bytes.length % 2) { carry = bytes[bytes.length - 1]; bytes = bytes.slice(0, -1); }
    if (!bytes.length) continue;
    if (first === null) first = (performance.now() - started) / 1000;
    const pcm = new Int16Array(bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.length));
    parts.push(pcm);
    samples += pcm.length;
    if (context) {
      const buffer = context.createBuffer(1, pcm.length, RATE);
      const channel = buffer.getChannelData(0);
      for (let i = 0; i < pcm.length; i++) channel[i] = pcm[i] / 32768;
      const source = context.createBufferSource();
      source.buffer = buffer;
      source.connect(context.destination);
      playAt = Math.max(playAt, context.currentTime + 0.05);
      source.start(playAt);
      playAt += buffer.duration;
    }
  }
  setAudio(wavFile(parts, samples), "wav");
  return { latency: (performance.now() - started) / 1000, first, audio: samples / RATE,
           cache: response.headers.get("X-Cache") };
}

// Captioned: the audio and one caption per sentence in one JSON answer; the caption being
// spoken is highlighted as the player moves, and a click on a caption plays from there.
async function speakCaptioned(body, started) {
  const response = await fetch("/v1/audio/captioned_speech", {
    method: "POST", headers: { "Content-Type": "application/json", ...authHeaders() },
    body: JSON.stringify({
      model: "chattts", input: body.text, voice: body.voice || `seed:${body.seed}`,
      seed: body.seed, speed: body.speed, refine_text: body.refine_text,
      response_format: body.format,
    }),
  });
  if (!response.ok) return response;
  const answer = await response.json();
  const bytes = Uint8Array.from(atob(answer.audio), (c) => c.charCodeAt(0));
  setAudio(new Blob([bytes], { type: answer.content_type }),
           body.format === "opus" ? "ogg" : body.format);
  showCaptions(answer.captions);
  $("player").play().catch(() => { /* autoplay refused: the controls are there */ });
  return { latency: (performance.now() - started) / 1000, first: null, audio: answer.seconds,
           cache: response.headers.get("X-Cache") };
}

function showCaptions(captions) {
  const list = $("captions");
  list.replaceChildren(...captions.map((caption) => {
    const item = document.createElement("li");
    item.dataset.start = caption.start;
    item.dataset.end = caption.end;
    item.title = caption.spoken_text;
    const time = document.createElement("span");
    time.className = "time";
    time.textContent = caption.start.toFixed(2) + " s";
    item.append(time, caption.text);
    item.addEventListener("click", () => {
      $("player").currentTime = caption.start;
      $("player").play().catch(() => {});
    });
    return item;
  }));
  list.hidden = !captions.length;
  highlightCaption();
}

function highlightCaption() {
  const now = $("player").currentTime;
  for (const item of $("captions").children) {
    const current = now >= parseFloat(item.dataset.start) && now < parseFloat(item.dataset.end);
    item.classList.toggle("current", current);
    if (current) item.setAttribute("aria-current", "true");
    else item.removeAttribute("aria-current");
  }
}

// The voice asked for: the chosen one (or the seed's), blended with a second one if set.
function voiceSpec(seed) {
  const first = $("voice").value, second = $("blend").value;
  const mix = parseInt($("mix").value, 10);
  if (!second || mix === 0) return first;
  const base = first || `seed:${seed}`;
  if (mix === 100) return second;
  return `${base}(${100 - mix})+${second}(${mix})`;
}

async function speakWhole(body, started) {
  const response = await fetch("/synthesize", {
    method: "POST", headers: { "Content-Type": "application/json", ...authHeaders() },
    body: JSON.stringify(body),
  });
  if (!response.ok) return response;
  const blob = await response.blob();
  setAudio(blob, body.format === "opus" ? "ogg" : body.format);
  $("player").play().catch(() => { /* autoplay refused: the controls are there */ });
  return { latency: (performance.now() - started) / 1000, first: null,
           audio: parseFloat(response.headers.get("X-Audio-Seconds") || "0"),
           cache: response.headers.get("X-Cache") };
}

async function speak(event) {
  event.preventDefault();
  const key = $("api-key").value.trim();
  if (key) keyStore.setItem("chattts-api-key", key);
  const text = $("text").value.trim();
  if (!text) { showMessage("Type something to say first."); $("text").focus(); return; }
  const body = { text, seed: parseInt($("seed").value || "0", 10),
                 speed: parseFloat($("speed").value), refine_text: $("refine").checked,
                 format: $("format").value };
  const voice = voiceSpec(body.seed);
  if (voice) body.voice = voice;
  const captioned = $("captions-on").checked;
  if (!captioned) { $("captions").hidden = true; $("captions").replaceChildren(); }
  const button = $("speak");
  button.disabled = true;
  showMessage("Speaking…", "info");
  const started = performance.now();
  try {
    const outcome = captioned ? await speakCaptioned(body, started)
      : body.format === "wav" ? await speakStreamed(body, started)
      : await speakWhole(body, started);
    if (outcome instanceof Response) {
      if (outcome.status === 401) needKey(await errorText(outcome));
      else showMessage(await errorText(outcome));
      return;
    }
    showMessage("");
    showResult(outcome);
    $("r-voice").textContent = voice || `seed:${body.seed}`;
  } catch (error) {
    showMessage("The request failed: " + error.message);
  } finally {
    button.disabled = false;
    refreshStatus();
  }
}

function sparkline(values) {
  const line = $("spark").querySelector("polyline");
  if (!values.length) { line.setAttribute("points", ""); return; }
  const top = Math.max(...values, 0.001);
  const step = values.length > 1 ? 300 / (values.length - 1) : 0;
  line.setAttribute("points", values.map((v, i) =>
    `${(i * step).toFixed(1)},${(58 - (v / top) * 54).toFixed(1)}`).join(" "));
}

async function refreshStatus() {
  let status;
  try {
    const response = await fetch("/status", { headers: authHeaders() });
    if (response.status === 401) { $("key-row").hidden = false; return; }
    status = await response.json();
  } catch (ignored) {
    $("s-state").textContent = "unreachable";
    return;
  }
  const pct = (x) => x == null ? "–" : Math.round(x * 100) + "%";
  const download = status.download;
  $("s-state").textContent = download && download.bytes_total
    ? `downloading the model: ${(download.bytes_done / 1e6).toFixed(0)} of ` +
      `${(download.bytes_total / 1e6).toFixed(0)} MB` +
      (download.error ? ` (retrying: ${download.error})` : "")
    : status.status;
  $("s-queue").textContent = `${status.queue_depth} (batch ${status.max_batch})`;
  $("s-flight").textContent = status.in_flight;
  $("s-cache").textContent = `${status.cache_entries} (${status.cache_megabytes} MB)`;
  $("s-hits").textContent = pct(status.cache_hit_rate);
  $("s-rtf").textContent = status.recent_real_time_factor == null ? "–"
    : status.recent_real_time_factor.toFixed(2);
  $("s-degraded").textContent = status.degraded ? "on" : "off";
  $("s-model").textContent =
    `${status.model} (${status.quantization} on ${status.linears}, decoder ${status.decoder})`;
  const up = status.uptime_seconds;
  $("s-uptime").textContent = up < 120 ? `${Math.round(up)} s` : up < 7200 ?
    `${Math.round(up / 60)} min` : `${(up / 3600).toFixed(1)} h`;
  $("s-updated").textContent = "updated " + new Date().toLocaleTimeString();
  sparkline(status.recent_latency_seconds);
  if (status.auth_required && !keyStore.getItem("chattts-api-key")) $("key-row").hidden = false;
}

async function loadVoices() {
  try {
    const response = await fetch("/v1/audio/voices", { headers: authHeaders() });
    if (!response.ok) return;
    const listing = await response.json();
    for (const select of [$("voice"), $("blend")]) {
      const chosen = select.value;
      select.replaceChildren(select.options[0]);
      for (const name of listing.voices) {
        const option = document.createElement("option");
        option.value = option.textContent = name;
        select.appendChild(option);
      }
      select.value = listing.voices.includes(chosen) ? chosen : "";
    }
    showStoredVoices(listing.details.filter((voice) => voice.source === "file"));
  } catch (ignored) { /* the seed's voice still works */ }
}

// -- voices from a recording: a sample and a consent, each a file or a microphone recording --

const recorded = { sample: null, consent: null };
let recorder = null;

function recordingOf(target) {
  const file = $(`${target}-file`).files[0];
  return recorded[target] || file || null;
}

async function toggleRecording(event) {
  const button = event.currentTarget, target = button.dataset.target;
  const label = target === "sample" ? "Record sample" : "Record consent";
  if (recorder && recorder.target === target) { recorder.stop(); return; }
  if (recorder) return;  // one recording at a time
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  } catch (error) {
    $(`${target}-state`).textContent = "No microphone: " + error.message + ". Upload a file instead.";
    return;
  }
  const chunks = [];
  recorder = new MediaRecorder(stream);
  recorder.target = target;
  recorder.addEventListener("dataavailable", (e) => { if (e.data.size) chunks.push(e.data); });
  recorder.addEventListener("stop", () => {
    stream.getTracks().forEach((track) => track.stop());
    recorded[target] = new Blob(chunks, { type: recorder.mimeType || "audio/webm" });
    $(`${target}-state`).textContent =
      `Recorded ${(recorded[target].size / 1024).toFixed(0)} KB.`;
    button.textContent = label;
    button.classList.remove("recording");
    recorder = null;
  });
  recorder.start();
  button.textContent = "Stop";
  button.classList.add("recording");
  $(`${target}-state`).textContent = "Recording… press Stop when done.";
}

function cloneMessage(text) {
  const box = $("clone-message");
  box.textContent = text;
  box.hidden = !text;
}

async function postForm(path, fields) {
  const form = new FormData();
  for (const [name, value] of Object.entries(fields)) {
    if (value instanceof Blob) form.append(name, value, value.name || `${name}.webm`);
    else form.append(name, value);
  }
  return fetch(path, { method: "POST", headers: authHeaders(), body: form });
}

async function createVoice(event) {
  event.preventDefault();
  const name = $("clone-name").value.trim();
  const sample = recordingOf("sample"), consent = recordingOf("consent");
  if (!/^[a-z0-9][a-z0-9_-]{0,63}$/.test(name)) {
    cloneMessage("Give the voice a name: a-z, 0-9, - and _."); $("clone-name").focus(); return;
  }
  if (!sample || !consent) {
    cloneMessage("Add a sample and a consent recording: upload or record each."); return;
  }
  const button = $("clone-create");
  button.disabled = true;
  cloneMessage("Creating the voice…");
  try {
    const consentAnswer = await postForm("/v1/audio/voice_consents", {
      recording: consent, name, language: $("clone-language").value.trim() || "zh-CN",
    });
    if (!consentAnswer.ok) { cloneMessage("Consent: " + await errorText(consentAnswer)); return; }
    const consentId = (await consentAnswer.json()).id;
    const fields = { audio_sample: sample, consent: consentId, name };
    const transcript = $("clone-transcript").value.trim();
    if (transcript) fields.transcript = transcript;
    const answer = await postForm("/v1/audio/voices", fields);
    if (!answer.ok) { cloneMessage("Voice: " + await errorText(answer)); return; }
    const voice = await answer.json();
    cloneMessage(`Created ${voice.name} (${voice.id}): pick it under Voice.`);
    recorded.sample = recorded.consent = null;
    await loadVoices();
    $("voice").value = voice.name;
  } catch (error) {
    cloneMessage("The request failed: " + error.message);
  } finally {
    button.disabled = false;
  }
}

function showStoredVoices(voices) {
  $("custom-voices").replaceChildren(...voices.map((voice) => {
    const item = document.createElement("li");
    const label = document.createElement("span");
    label.textContent = voice.name + " ";
    const kind = document.createElement("span");
    kind.className = "kind";
    kind.textContent = voice.type === "audio_sample" ? `from a recording, ${voice.id}`
      : "from an embedding";
    label.appendChild(kind);
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "secondary";
    remove.textContent = "Delete";
    remove.setAttribute("aria-label", `Delete ${voice.name}`);
    remove.addEventListener("click", async () => {
      const response = await fetch(`/v1/audio/voices/${encodeURIComponent(voice.id || voice.name)}`,
                                   { method: "DELETE", headers: authHeaders() });
      cloneMessage(response.ok ? `Deleted ${voice.name}.` : await errorText(response));
      loadVoices();
    });
    item.append(label, remove);
    return item;
  }));
  if (!voices.length) {
    const empty = document.createElement("li");
    empty.textContent = "None yet.";
    $("custom-voices").replaceChildren(empty);
  }
}

$("sample-record").addEventListener("click", toggleRecording);
$("consent-record").addEventListener("click", toggleRecording);
for (const target of ["sample", "consent"]) {
  $(`${target}-file`).addEventListener("change", () => {
    recorded[target] = null;
    const file = $(`${target}-file`).files[0];
    $(`${target}-state`).textContent = file ? `File: ${file.name}` : "";
  });
}
$("clone-form").addEventListener("submit", createVoice);

$("mix").addEventListener("input", () => {
  $("mix-value").textContent = $("mix").value + "%";
});
$("player").addEventListener("timeupdate", highlightCaption);
$("player").addEventListener("seeked", highlightCaption);
$("speed").addEventListener("input", () => {
  $("speed-value").textContent = parseFloat($("speed").value).toFixed(2);
});
$("api-key").addEventListener("change", () => {
  keyStore.setItem("chattts-api-key", $("api-key").value.trim());
  loadVoices(); refreshStatus();
});
$("speak-form").addEventListener("submit", speak);
$("api-key").value = keyStore.getItem("chattts-api-key") || "";
loadVoices();
refreshStatus();
setInterval(refreshStatus, 3000);
