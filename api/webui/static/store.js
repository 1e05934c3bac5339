// Conversations and settings kept in the browser's localStorage, never on the server.
// A conversation: {id, title, model, messages: [{role, content, stats?, stopped?}], updated}.
// `content` is what the OpenAI API takes: a string, or an array of parts, the images a message
// carries as {type: "image_url", image_url: {url}} (data URLs) and its text as {type: "text", text}.

const CONVERSATIONS = "base.conversations";
const CURRENT = "base.current";
const KEY = "base.apiKey";
const MODEL = "base.model";

function read(name, fallback) {
  try {
    return JSON.parse(localStorage.getItem(name)) ?? fallback;
  } catch {
    return fallback;
  }
}

export function loadConversations() {
  return read(CONVERSATIONS, []);
}

// Whether the conversations were kept: images can pass the browser's storage quota, and then the
// conversations live on in the page until it closes.
export function saveConversations(conversations) {
  try {
    localStorage.setItem(CONVERSATIONS, JSON.stringify(conversations));
    return true;
  } catch {
    return false;
  }
}

export function newConversation(model) {
  return {id: crypto.randomUUID(), title: "New chat", model, messages: [], updated: Date.now()};
}

export const currentId = () => localStorage.getItem(CURRENT);
export const setCurrentId = (id) => localStorage.setItem(CURRENT, id);
export const apiKey = () => localStorage.getItem(KEY) || "";
export const setApiKey = (key) => localStorage.setItem(KEY, key);
export const lastModel = () => localStorage.getItem(MODEL);
export const setLastModel = (model) => localStorage.setItem(MODEL, model);
