"""plan.to_html: one self-contained page, loaded in a real headless chromium (Debian's package,
driven by selenium through chromium-driver): no console errors, the timeline drawn and seen in a
screenshot, explain shown for what is clicked.

Selenium comes with the ``test`` extra. The browser is the system's chromium and chromedriver
where they are on PATH (``apt-get install chromium chromium-driver``, as ``.ci/run`` does), else
the Chrome for Testing that Selenium Manager fetches; without either this test fails, saying so."""
import re
import shutil
import struct
import zlib

import pytest
import torch

import autoshard
from models import GPT

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")


def gpt_plan():
    with torch.device("meta"):
        model = GPT(vocab=1024, d=256, heads=4, layers=4, seq=128)
        idx = torch.empty(64, 128, dtype=torch.long)
    return autoshard.plan(model, (idx, idx), mesh=(2, 2))


@pytest.fixture(scope="module")
def browser():
    try:
        from selenium import webdriver
        from selenium.common.exceptions import WebDriverException
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail('the page is checked in a real browser driven by selenium: pip install -e ".[test]"')
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1700,1200"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        if CHROMIUM and DRIVER:   # the system's browser
            options.binary_location = CHROMIUM
            driver = webdriver.Chrome(service=Service(DRIVER), options=options)
        else:   # Selenium Manager fetches Chrome for Testing and its driver
            driver = webdriver.Chrome(options=options)
    except WebDriverException as e:
        pytest.fail("the page is checked in a real headless browser, and none started: apt-get install -y "
                    f"chromium chromium-driver, or let Selenium Manager download Chrome ({e.msg})")
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def page(tmp_path_factory, browser):
    plan = gpt_plan()
    path = tmp_path_factory.mktemp("html") / "plan.html"
    plan.to_html(path)
    browser.get(path.as_uri())
    browser.get_log("browser")
    return plan, path, browser


def test_the_page_is_self_contained(page):
    plan, path, _ = page
    text = path.read_text()
    assert not re.search(r"<(link|img|iframe)\b|\bsrc=|@import|url\(", text)
    assert set(re.findall(r"https?://[^\s\"']+", text)) <= {"http://www.w3.org/2000/svg"}   # a namespace, not a fetch
    assert plan.to_html() == text   # the same page as text


def test_the_page_loads_without_console_errors_and_shows_the_timeline(page, tmp_path):
    from selenium.webdriver.common.by import By
    plan, _, driver = page
    assert driver.get_log("browser") == []
    head = driver.find_element(By.ID, "head").text
    assert f"mesh {plan.mesh_shape}" in head and "per step" in head
    bars = driver.find_elements(By.CSS_SELECTOR, "#timeline rect.bar")
    compute = sum(n.kind == "op" and n.compute > 0 for n in plan.nodes.values())
    assert len(bars) >= compute + len(plan.collectives)   # forward and backward of each op, every collective
    hidden = [b for b in bars if b.get_attribute("fill-opacity") == "0.35"]
    assert hidden and len(hidden) < len(bars)
    timeline = driver.find_element(By.ID, "timeline")
    assert timeline.is_displayed() and timeline.size["width"] > 500
    shot = tmp_path / "timeline.png"
    assert timeline.screenshot(str(shot))
    colors = _colors(shot.read_bytes())
    assert colors[(0x5c, 0xb8, 0x5c)] > 1000     # forward compute
    assert colors[(0x3d, 0x8b, 0x3d)] > 1000     # backward compute
    assert driver.get_log("browser") == []


def test_a_click_explains_the_tensor(page):
    from selenium.webdriver.common.by import By
    plan, _, driver = page
    why = driver.find_element(By.ID, "why")
    compute = [b for b in driver.find_elements(By.CSS_SELECTOR, "#timeline rect.bar") if b.get_attribute("fill") == "#5cb85c"]
    bar = compute[3]   # a forward op: its tooltip starts with its node's name
    bar.click()
    node = bar.find_element(By.TAG_NAME, "title").get_attribute("textContent").split()[0]
    n = plan.nodes[node]
    assert why.text == plan.explain(n.fqn if n.kind == "param" else node).strip()
    box = driver.find_element(By.ID, "filter")
    box.send_keys("blocks.2.fc.weight")
    rows = driver.find_elements(By.CSS_SELECTOR, "#nodes tr")
    assert len(rows) == 1
    rows[0].click()
    assert why.text == plan.explain("blocks.2.fc.weight").strip()
    folded = [r for r in driver.find_elements(By.CSS_SELECTOR, "#table tr.click") if r.text.strip().startswith("qkv")]
    folded[0].click()
    assert "qkv" in why.text
    assert driver.get_log("browser") == []


def _colors(png: bytes) -> dict:
    """Pixel count per RGB colour of an 8-bit RGB or RGBA PNG (what chromium writes)."""
    from collections import Counter
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(png):
        length, kind = struct.unpack(">I4s", png[pos:pos + 8])
        body = png[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, ctype = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and ctype in (2, 6), (depth, ctype)
            bpp = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw, stride = zlib.decompress(idat), width * bpp
    prev, counts = bytearray(stride), Counter()
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        counts.update(tuple(line[i:i + 3]) for i in range(0, stride, bpp))
        prev = line
    return counts


def test_a_pipeline_plans_page_draws_its_schedule_and_bubble(browser, tmp_path):
    """PipelinePlan.to_html: the stages' forwards and backwards drawn in time, a rectangle each,
    the bubble left blank; each stage's own plan on the page."""
    from selenium.webdriver.common.by import By
    with torch.device("meta"):
        model = GPT(vocab=1024, d=256, heads=4, layers=4, seq=128)
        idx = torch.empty(64, 128, dtype=torch.long)
    plan = autoshard.plan(model, (idx, idx), mesh=(2, 2), pipeline=2, microbatches=4, verbose=False)
    path = tmp_path / "pipeline.html"
    text = plan.to_html(path)
    assert not re.search(r"<(link|img|iframe|script)\b|\bsrc=|@import|url\(", text)
    browser.get(path.as_uri())
    assert browser.get_log("browser") == []
    work = browser.find_elements(By.CSS_SELECTOR, "#schedule rect.work")
    assert sorted(w.get_attribute("data-work") for w in work) == sorted(
        f"{kind}{i}" for kind in "FB" for i in range(4) for _ in range(2))   # each microbatch's, on each stage
    lane = browser.find_elements(By.CSS_SELECTOR, "#schedule rect.lane")
    assert len(lane) == 2
    busy = sum(float(w.get_attribute("width")) + 2 for w in work)
    assert busy < sum(float(x.get_attribute("width")) for x in lane)   # the bubble: blank on the lanes
    assert f"bubble {plan.bubble:.0%}" in browser.find_element(By.ID, "head").text
    assert len(browser.find_elements(By.CSS_SELECTOR, "details.stage")) == 2
