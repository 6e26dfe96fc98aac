"""The playground page in a real browser: headless Chromium (Debian's) driven by Selenium,
against a real server on loopback with the tiny model. A screenshot of each run is kept in
``artifacts/``."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import requests
from conftest import REPO

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
ARTIFACTS = REPO / "artifacts"
KEY = "playground-key-0123456789"

if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
    pytest.fail(
        "the playground test needs Debian's chromium and chromium-driver "
        "(script/test installs them)",
        pytrace=False,
    )


@pytest.fixture(scope="module")
def microphone(tmp_path_factory) -> Path:
    """What Chromium's fake microphone plays, in a loop."""
    import soundfile

    from benchmarks.engine import voiced_recording

    path = tmp_path_factory.mktemp("microphone") / "voice.wav"
    soundfile.write(path, voiced_recording(3, 4.0, 48_000), 48_000, subtype="PCM_16")
    return path


@pytest.fixture(scope="module")
def browser(tmp_path_factory, microphone):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--autoplay-policy=no-user-gesture-required",
        # getUserMedia answered without a prompt, by a microphone that plays this file
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={microphone}",
        "--window-size=1100,1400",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def server(start_server):
    server = start_server(CHATTTS_MAX_NEW_TOKENS="150")
    server.wait_ready()
    return server


def wait_for(predicate, timeout=60.0, interval=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {predicate.__doc__ or predicate}")


def text_of(driver, element_id):
    return driver.find_element("id", element_id).text


def speak(driver, text, audio_format="wav"):
    from selenium.webdriver.support.ui import Select

    box = driver.find_element("id", "text")
    box.clear()
    box.send_keys(text)
    Select(driver.find_element("id", "format")).select_by_value(audio_format)
    driver.execute_script(
        "document.getElementById('player').removeAttribute('src');"
        "document.getElementById('player').load();"
    )
    driver.find_element("id", "speak").click()


def error_message(driver):
    """an error message on the page (not the "Speaking…" notice)"""
    text = text_of(driver, "message")
    return text if text and not text.startswith("Speaking") else ""


def player_duration(driver):
    """the <audio> element's duration once its source has loaded"""
    return driver.execute_script(
        "const p = document.getElementById('player');"
        "return p.src && isFinite(p.duration) && p.duration > 0 ? p.duration : 0;"
    )


def test_page_speaks_streams_reports_and_shows_errors(browser, server):
    ARTIFACTS.mkdir(exist_ok=True)
    browser.get(server.url + "/")
    assert browser.title == "ChatTTS playground"
    # no external assets: every script, stylesheet and image comes from this service
    sources = browser.execute_script(
        "return [...document.querySelectorAll('script[src],link[href],img[src]')]"
        ".map(e => e.src || e.href);"
    )
    assert sources and all(s.startswith(server.url) for s in sources), sources
    # every control has a label
    unlabelled = browser.execute_script(
        "return [...document.querySelectorAll('input,select,textarea')].filter(e =>"
        " !document.querySelector(`label[for='${e.id}']`)).map(e => e.id);"
    )
    assert unlabelled == []

    wait_for(lambda: text_of(browser, "s-state") == "ready")
    voices = browser.execute_script(
        "return [...document.querySelectorAll('#voice option')].map(o => o.value);"
    )
    wait_for(
        lambda: (
            len(browser.execute_script("return document.querySelectorAll('#voice option');")) > 6
        )
    )
    voices = browser.execute_script(
        "return [...document.querySelectorAll('#voice option')].map(o => o.value);"
    )
    assert {"alloy", "nova", "shimmer"} <= set(voices)

    # streamed WAV: played as it arrives, then kept in <audio> with a download link
    speak(browser, "你好，这是浏览器里的测试。")
    duration = wait_for(lambda: player_duration(browser))
    assert duration > 0
    assert text_of(browser, "r-cache") == "MISS"
    assert text_of(browser, "r-latency").endswith(" s")
    assert text_of(browser, "r-first").endswith(" s")
    audio_seconds = float(text_of(browser, "r-audio").split()[0])
    assert abs(audio_seconds - duration) < 0.05
    assert browser.find_element("id", "download").is_displayed()

    # MP3 through the whole-file path, same words: the synthesis comes from the cache
    speak(browser, "你好，这是浏览器里的测试。", "mp3")
    wait_for(lambda: text_of(browser, "r-cache") == "HIT")
    assert wait_for(lambda: player_duration(browser)) > 0

    wait_for(lambda: text_of(browser, "s-hits") not in ("–", ""))
    browser.save_screenshot(str(ARTIFACTS / "playground.png"))

    # an API error is shown as a readable message
    speak(browser, "[cough] 你好")
    message = wait_for(lambda: error_message(browser))
    assert "400" in message and "unknown control token" in message

    # the status panel follows: requests counted, hit rate, a sparkline of latencies
    wait_for(lambda: text_of(browser, "s-hits") not in ("–", ""))
    points = wait_for(
        lambda: browser.find_element("css selector", "#spark polyline").get_attribute("points")
    )
    assert len(points.split()) >= 2
    assert "int8" in text_of(browser, "s-model")
    assert not browser.find_element("id", "key-row").is_displayed()  # no keys configured
    browser.save_screenshot(str(ARTIFACTS / "playground-error.png"))

    # a phone-sized screen: nothing wider than the viewport
    browser.set_window_size(390, 844)
    overflow = browser.execute_script(
        "return document.documentElement.scrollWidth > window.innerWidth;"
    )
    browser.save_screenshot(str(ARTIFACTS / "playground-phone.png"))
    browser.set_window_size(1100, 1400)
    assert not overflow


def test_keyboard_alone_can_speak(browser, server):
    from selenium.webdriver.common.keys import Keys

    browser.get(server.url + "/")
    wait_for(lambda: text_of(browser, "s-state") == "ready")
    box = browser.find_element("id", "text")
    box.clear()
    box.send_keys("键盘操作。")
    for _ in range(30):  # tab to the Speak button and press Enter
        browser.switch_to.active_element.send_keys(Keys.TAB)
        if browser.switch_to.active_element.get_attribute("id") == "speak":
            break
    assert browser.switch_to.active_element.get_attribute("id") == "speak"
    browser.switch_to.active_element.send_keys(Keys.ENTER)
    assert wait_for(lambda: player_duration(browser)) > 0


def test_page_asks_for_a_key_when_keys_are_configured(browser, start_server):
    server = start_server(CHATTTS_API_KEYS=KEY, CHATTTS_MAX_NEW_TOKENS="100")
    server.wait_ready()
    assert requests.get(server.url + "/", timeout=10).status_code == 200  # the page is open
    browser.get(server.url + "/")
    wait_for(lambda: browser.find_element("id", "key-row").is_displayed())
    speak(browser, "没有钥匙。")
    assert "401" in wait_for(lambda: error_message(browser))
    browser.find_element("id", "api-key").send_keys(KEY)
    speak(browser, "有钥匙了。")
    assert wait_for(lambda: player_duration(browser)) > 0
    stored = browser.execute_script("return sessionStorage.getItem('chattts-api-key');")
    local = browser.execute_script("return localStorage.length;")
    assert stored == KEY and local == 0  # kept for the browser session only
    wait_for(lambda: text_of(browser, "s-state") == "ready")


def test_page_explains_empty_too_long_and_overloaded(browser, start_server):
    # a queue of one segment: a two-segment text is refused at once with 503 and Retry-After
    server = start_server(
        CHATTTS_MAX_QUEUE="1", CHATTTS_MAX_CHARS="150", CHATTTS_MAX_NEW_TOKENS="100"
    )
    server.wait_ready()
    browser.get(server.url + "/")
    wait_for(lambda: text_of(browser, "s-state") == "ready")

    browser.find_element("id", "text").clear()
    browser.find_element("id", "speak").click()
    assert "Type something" in wait_for(lambda: error_message(browser))

    speak(browser, "这是一个比较长的句子，用来把文本分成两段。" * 6)  # 132 characters, 2 segments
    busy = wait_for(lambda: error_message(browser))
    assert busy.startswith("Busy (503)") and "no room" in busy and "Try again in" in busy

    speak(browser, "太长了。" * 40)  # 160 characters
    too_long = wait_for(lambda: error_message(browser))
    assert "413" in too_long and "the limit is 150" in too_long
    browser.save_screenshot(str(ARTIFACTS / "playground-busy.png"))


def test_captions_follow_the_player_and_voices_blend(browser, server):
    from selenium.webdriver.support.ui import Select

    browser.get(server.url + "/")
    wait_for(lambda: text_of(browser, "s-state") == "ready")
    wait_for(lambda: len(browser.find_elements("css selector", "#blend option")) > 6)

    # a blend of two voices from the mixer: the request names both, weighted by the slider
    Select(browser.find_element("id", "voice")).select_by_value("alloy")
    Select(browser.find_element("id", "blend")).select_by_value("echo")
    browser.execute_script(
        "const mix = document.getElementById('mix'); mix.value = 30;"
        "mix.dispatchEvent(new Event('input'));"
    )
    assert text_of(browser, "mix-value") == "30%"
    browser.find_element("id", "captions-on").click()
    speak(browser, "First sentence here. 第二句话。 And a third one.", "mp3")
    wait_for(lambda: text_of(browser, "r-voice") == "alloy(70)+echo(30)")
    assert wait_for(lambda: player_duration(browser)) > 0
    assert not error_message(browser)

    # one caption per sentence under the player, as written, with its start time
    items = browser.find_elements("css selector", "#captions li")
    assert [item.text.split(" s", 1)[1].strip() for item in items] == [
        "First sentence here.",
        "第二句话。",
        "And a third one.",
    ]
    spans = browser.execute_script(
        "return [...document.querySelectorAll('#captions li')]"
        ".map(li => [parseFloat(li.dataset.start), parseFloat(li.dataset.end)]);"
    )
    assert all(start < end for start, end in spans)
    assert all(before[1] < after[0] for before, after in zip(spans, spans[1:]))

    # the caption being spoken is highlighted as the player moves; a click seeks to it
    browser.execute_script("document.getElementById('player').pause();")
    for index, (start, end) in enumerate(spans):
        browser.execute_script(
            "document.getElementById('player').currentTime = arguments[0];", (start + end) / 2
        )
        wait_for(
            lambda index=index: (
                browser.execute_script(
                    "return [...document.querySelectorAll('#captions li')]"
                    ".map(li => li.classList.contains('current'));"
                )
                == [i == index for i in range(len(spans))]
            )
        )
        assert items[index].get_attribute("aria-current") == "true"
    browser.save_screenshot(str(ARTIFACTS / "playground-captions.png"))
    items[0].click()
    wait_for(
        lambda: (
            browser.execute_script("return document.getElementById('player').currentTime;")
            < spans[0][1]
        )
    )
    browser.find_element("id", "captions-on").click()  # off again for the other tests


def test_a_voice_from_a_recording_is_made_used_and_deleted(browser, server, microphone):
    """Record the sample with the microphone (MediaRecorder), upload the consent as a file,
    create the voice, speak with it, delete it."""
    browser.get(server.url + "/")
    wait_for(lambda: text_of(browser, "s-state") == "ready")
    browser.find_element("id", "clone-name").send_keys("mic-voice")
    browser.find_element("id", "clone-transcript").send_keys("今天天气很好。")
    record = browser.find_element("id", "sample-record")
    record.click()
    wait_for(lambda: "Recording" in text_of(browser, "sample-state"))
    time.sleep(2.5)
    record.click()
    wait_for(lambda: "Recorded" in text_of(browser, "sample-state"))
    browser.find_element("id", "consent-file").send_keys(str(microphone))
    browser.find_element("id", "clone-create").click()

    def outcome():
        """the voice's creation reported, done or refused"""
        text = text_of(browser, "clone-message")
        return text if text.startswith(("Created", "Voice:", "Consent:", "The request")) else ""

    created = wait_for(outcome)
    assert created.startswith("Created mic-voice (voice_"), created
    assert browser.find_element("id", "voice").get_attribute("value") == "mic-voice"
    stored = text_of(browser, "custom-voices")
    assert "mic-voice" in stored and "from a recording" in stored
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "playground-voice-from-a-recording.png"))

    speak(browser, "用录下来的声音说话。")
    wait_for(lambda: player_duration(browser))
    assert text_of(browser, "r-voice") == "mic-voice"
    listing = requests.get(server.url + "/v1/audio/voices", timeout=10).json()
    assert "mic-voice" in listing["voices"]

    browser.find_element("css selector", "[aria-label='Delete mic-voice']").click()
    wait_for(lambda: "Deleted mic-voice" in text_of(browser, "clone-message"))
    wait_for(lambda: "mic-voice" not in text_of(browser, "custom-voices"))
    options = browser.execute_script(
        "return [...document.querySelectorAll('#voice option')].map(o => o.value);"
    )
    assert "mic-voice" not in options
    listing = requests.get(server.url + "/v1/audio/voices", timeout=10).json()
    assert "mic-voice" not in listing["voices"]


def test_the_browser_plays_a_streamed_wav(browser, server):
    """A WAV streamed by /v1/audio/speech (open-ended header, a whole last block) decodes in
    the browser's own <audio> element, as ffmpeg, libsndfile and wave take it in
    test_speech_api."""
    browser.get(server.url + "/")
    wait_for(lambda: text_of(browser, "s-state") == "ready")
    browser.set_script_timeout(60)
    outcome = browser.execute_async_script(
        """
        const done = arguments[arguments.length - 1];
        const body = {model: "tts-1", voice: "alloy", input: "浏览器播放流式的WAV。",
                      response_format: "wav"};
        fetch("/v1/audio/speech", {method: "POST", headers: {"Content-Type": "application/json"},
                                   body: JSON.stringify(body)})
          .then(async (response) => {
            const streamed = !response.headers.has("Content-Length");
            const blob = await response.blob();
            const audio = new Audio();
            audio.addEventListener("loadedmetadata", () => done(
              {streamed, duration: audio.duration, bytes: blob.size}));
            audio.addEventListener("error", () => done({streamed, error: audio.error.code}));
            audio.src = URL.createObjectURL(blob);
          })
          .catch((error) => done({error: String(error)}));
        """
    )
    assert "error" not in outcome, outcome
    assert outcome["streamed"] and outcome["duration"] > 0.1
    # the duration the browser reads is the samples sent (padding included), within a block
    assert abs(outcome["duration"] - (outcome["bytes"] - 44) / 2 / 24_000) < 0.1
