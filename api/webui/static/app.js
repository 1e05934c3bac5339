// The chat page: a list of conversations, a model picker, the messages and a composer.
// Each answer streams from /v1/chat/completions; Stop aborts the fetch, which aborts the request.
// Images picked, pasted or dropped into the composer go with the next message (images.js).

import {listModels, streamChat, Unauthorized} from "./api.js";
import {contentOf, imageFilesOf, imagesOf, readImage, thumbnail} from "./images.js";
import {loadLibraries, renderInto} from "./render.js";
import * as store from "./store.js";

const $ = (id) => document.getElementById(id);
const state = {conversations: store.loadConversations(), current: null, controller: null, attachments: []};

function askKey() {
  const dialog = $("key-dialog");
  $("key-input").value = "";
  dialog.showModal();
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve($("key-input").value.trim() || null), {once: true});
  });
}

function notice(text) {
  $("notice").textContent = text;
}

function save() {
  state.current.updated = Date.now();
  if (!store.saveConversations(state.conversations)) {
    notice("The browser has no room to keep this conversation's images; it stays until the page closes.");
  }
  renderConversations();
}

function select(conversation) {
  state.current = conversation;
  store.setCurrentId(conversation.id);
  renderConversations();
  renderMessages();
}

function startNew() {
  const conversation = store.newConversation($("model").value);
  state.conversations.unshift(conversation);
  select(conversation);
  $("prompt").focus();
}

function remove(conversation) {
  state.conversations = state.conversations.filter((c) => c.id !== conversation.id);
  store.saveConversations(state.conversations);
  if (state.current.id === conversation.id) {
    state.conversations.length ? select(state.conversations[0]) : startNew();
  } else {
    renderConversations();
  }
}

function renderConversations() {
  const list = $("conversations");
  list.replaceChildren();
  for (const conversation of state.conversations) {
    const item = document.createElement("li");
    item.className = conversation.id === state.current?.id ? "conversation current" : "conversation";
    const open = document.createElement("button");
    open.className = "open";
    open.textContent = conversation.title;
    open.addEventListener("click", () => select(conversation));
    const drop = document.createElement("button");
    drop.className = "delete";
    drop.textContent = "×";
    drop.title = "Delete this conversation";
    drop.addEventListener("click", () => remove(conversation));
    item.append(open, drop);
    list.append(item);
  }
}

function textOf(content) {
  return typeof content === "string" ? content : content.filter((p) => p.type === "text").map((p) => p.text).join("");
}

function describe(stats, stopped) {
  const parts = [];
  if (stats?.tokensPerSecond) parts.push(`${stats.tokensPerSecond.toFixed(1)} tok/s`);
  if (stats?.completionTokens != null) parts.push(`${stats.completionTokens} tokens`);
  if (stats?.promptTokens != null) parts.push(`prompt ${stats.promptTokens} (${stats.cachedTokens ?? 0} cached)`);
  if (stopped) parts.push("stopped");
  return parts.join(" · ");
}

function messageElement(message, index) {
  const element = document.createElement("article");
  element.className = `message ${message.role}`;
  const images = imagesOf(message.content);
  if (images.length) {
    const row = document.createElement("div");
    row.className = "images";
    row.append(...images.map(thumbnail));
    element.append(row);
  }
  const body = document.createElement("div");
  body.className = "body";
  if (message.role === "assistant") renderInto(body, textOf(message.content));
  else body.textContent = textOf(message.content);
  element.append(body);
  if (message.role === "user") element.append(editButton(index));
  if (message.role === "assistant") {
    const stats = document.createElement("div");
    stats.className = "stats";
    stats.textContent = describe(message.stats, message.stopped);
    element.append(stats);
  }
  return element;
}

function renderMessages() {
  const messages = state.current.messages.map(messageElement);
  $("messages").replaceChildren(...messages);
  $("messages").scrollTop = $("messages").scrollHeight;
}

function editButton(index) {
  const button = document.createElement("button");
  button.className = "edit";
  button.textContent = "Edit";
  button.addEventListener("click", () => editMessage(index, button.parentElement));
  return button;
}

// Replaces the message with a text box; sending it drops everything after and answers again (with
// the message's images).
function editMessage(index, element) {
  if (state.controller) return;
  const box = document.createElement("textarea");
  box.className = "edit-box";
  box.value = textOf(state.current.messages[index].content);
  const images = imagesOf(state.current.messages[index].content);
  const resend = document.createElement("button");
  resend.className = "resend";
  resend.textContent = "Send";
  resend.addEventListener("click", () => {
    state.current.messages = state.current.messages.slice(0, index);
    send(box.value, images);
  });
  element.replaceChildren(box, resend);
  box.focus();
}

async function send(text, images = []) {
  if ((!text.trim() && !images.length) || state.controller) return;
  const conversation = state.current;
  conversation.model = $("model").value;
  if (!conversation.messages.length) conversation.title = text.trim().slice(0, 40) || "Image";
  conversation.messages.push({role: "user", content: contentOf(text, images)});
  const answer = {role: "assistant", content: "", stats: null};
  conversation.messages.push(answer);
  save();
  renderMessages();
  await answerInto(conversation, answer);
}

async function answerInto(conversation, answer) {
  const element = $("messages").lastElementChild;
  const body = element.querySelector(".body");
  state.controller = new AbortController();
  setBusy(true);
  let pending = false;
  const onDelta = ({content}) => {
    answer.content += content;
    if (!pending) {
      pending = true; // one render a frame, however fast the tokens come
      requestAnimationFrame(() => {
        pending = false;
        renderInto(body, answer.content);
      });
    }
  };
  const history = conversation.messages.slice(0, -1).map(({role, content}) => ({role, content}));
  try {
    answer.stats = await streamChat({
      model: conversation.model, messages: history, signal: state.controller.signal, onDelta, askKey,
    });
  } catch (error) {
    if (error.name === "AbortError") answer.stopped = true;
    else notice(error instanceof Unauthorized ? "An API key is needed." : error.message);
  } finally {
    state.controller = null;
    setBusy(false);
    save();
    renderMessages();
  }
}

// Reads image files into the composer's attachments; a file the server would refuse is named in the notice.
async function attach(files) {
  for (const file of files) {
    try {
      state.attachments.push(await readImage(file));
    } catch (error) {
      notice(error.message);
    }
  }
  renderAttachments();
}

function renderAttachments() {
  const items = state.attachments.map((url, index) => {
    const item = document.createElement("span");
    item.className = "attachment";
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "remove";
    remove.textContent = "×";
    remove.title = "Remove this image";
    remove.addEventListener("click", () => {
      state.attachments.splice(index, 1);
      renderAttachments();
    });
    item.append(thumbnail(url, index), remove);
    return item;
  });
  $("attachments").replaceChildren(...items);
}

function wireImages() {
  $("attach").addEventListener("click", () => $("image-input").click());
  $("image-input").addEventListener("change", () => {
    attach(imageFilesOf($("image-input").files));
    $("image-input").value = "";
  });
  $("prompt").addEventListener("paste", (event) => {
    const files = imageFilesOf(event.clipboardData?.files);
    if (!files.length) return; // text pastes as text
    event.preventDefault();
    attach(files);
  });
  const composer = $("composer");
  composer.addEventListener("dragover", (event) => {
    if (!event.dataTransfer?.types.includes("Files")) return;
    event.preventDefault();
    composer.classList.add("dropping");
  });
  composer.addEventListener("dragleave", () => composer.classList.remove("dropping"));
  composer.addEventListener("drop", (event) => {
    composer.classList.remove("dropping");
    const files = imageFilesOf(event.dataTransfer?.files);
    if (!files.length) return;
    event.preventDefault();
    attach(files);
  });
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

async function loadModels() {
  try {
    const models = await listModels(askKey);
    const options = models.map((card) => {
      const status = card.status?.value ?? card.status ?? card.state;
      const option = new Option(status ? `${card.id} (${status})` : card.id, card.id);
      return option;
    });
    $("model").replaceChildren(...options);
    const wanted = state.current?.model || store.lastModel();
    if (models.some((card) => card.id === wanted)) $("model").value = wanted;
  } catch (error) {
    notice(error instanceof Unauthorized ? "An API key is needed." : error.message);
  }
}

function wire() {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    if (state.controller) return;
    const text = $("prompt").value;
    const images = state.attachments;
    $("prompt").value = "";
    state.attachments = [];
    renderAttachments();
    send(text, images);
  });
  wireImages();
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller?.abort());
  $("new-chat").addEventListener("click", startNew);
  $("model").addEventListener("change", () => store.setLastModel($("model").value));
}

async function start() {
  wire();
  const hasMarkdown = await loadLibraries();
  if (!hasMarkdown) notice("Answers are shown as plain text: this install has no markdown libraries.");
  const saved = state.conversations.find((c) => c.id === store.currentId());
  if (saved) select(saved);
  else if (state.conversations.length) select(state.conversations[0]);
  await loadModels();
  if (!state.current) startNew();
  document.body.dataset.ready = "true";
}

start();
