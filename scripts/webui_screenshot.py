"""The README's screenshot of the chat page (docs/webui.png): `base serve MODEL`, a question in headless
Chromium, the answer as it ends.

    python scripts/webui_screenshot.py [MODEL] [--out docs/webui.png] [--port 8765]

MODEL defaults to HuggingFaceTB/SmolLM2-135M-Instruct (`make model` puts it in the store). Needs
Debian's chromium and chromium-driver, and selenium (pip install selenium).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import httpx
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.support.ui import WebDriverWait

QUESTIONS = ["What is a prime number?", "Write a Python function that checks whether a number is prime."]


def wait_for_server(url: str, process: subprocess.Popen) -> None:
    for _ in range(600):
        if process.poll() is not None:
            sys.exit(f"base serve exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    sys.exit("base serve did not start within 2 minutes")


def browser() -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1200,860"):
        options.add_argument(argument)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def ask(driver: webdriver.Chrome, question: str) -> None:
    driver.find_element("css selector", "#prompt").send_keys(question)
    driver.find_element("css selector", "#send").click()
    WebDriverWait(driver, 300).until(lambda d: not d.find_element("css selector", "#send").get_attribute("hidden"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("model", nargs="?", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--out", default="docs/webui.png")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    command = ["base", "serve", args.model, "--port", str(args.port), "--temperature", "0", "--max-tokens", "200"]
    process = subprocess.Popen(command)
    try:
        wait_for_server(url, process)
        driver = browser()
        try:
            driver.get(url + "/")
            WebDriverWait(driver, 30).until(lambda d: d.execute_script("return document.body.dataset.ready"))
            for question in QUESTIONS:
                ask(driver, question)
            time.sleep(0.3)  # the last frame's render
            driver.save_screenshot(args.out)
        finally:
            driver.quit()
    finally:
        process.terminate()
        process.wait(30)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
