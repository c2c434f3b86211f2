// The playground: chat and raw completion against this server's OpenAI routes, streamed
// over server-sent events. Model output is only ever inserted as text, never as HTML.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  // Settings the page remembers in this browser (never sent anywhere but the requests).
  const REMEMBERED = ["system-prompt", "temperature", "top-p", "max-tokens", "seed", "stop",
                      "response-format", "json-schema", "tools", "tool-choice"];
  const KEY_STORAGE = "vllmpy.apiKey";

  const state = {
    model: null,
    apiKey: sessionStorage.getItem(KEY_STORAGE) || "",
    messages: [],        // the conversation as sent to /v1/chat/completions
    controller: null,    // the AbortController of the generation in flight
  };

  class InputError extends Error {}

  // ---- server -------------------------------------------------------------------------

  function headers() {
    const h = { "Content-Type": "application/json" };
    if (state.apiKey) h.Authorization = `Bearer ${state.apiKey}`;
    return h;
  }

  async function errorText(response) {
    const text = await response.text();
    try {
      const body = JSON.parse(text);
      if (body && body.error && body.error.message) return body.error.message;
    } catch (_) { /* not JSON: show the text */ }
    return text || `HTTP ${response.status}`;
  }

  async function loadModel() {
    let response;
    try {
      response = await fetch("/v1/models", { headers: headers() });
    } catch (e) {
      showError(`Cannot reach the server: ${e.message}`);
      return;
    }
    if (response.status === 401) {
      askForKey(state.apiKey ? "That key was refused; enter the server's API key." : null);
      $("model-name").textContent = "API key needed";
      return;
    }
    if (!response.ok) {
      showError(await errorText(response));
      return;
    }
    const card = (await response.json()).data[0];
    state.model = card.id;
    $("model-name").textContent = `${card.id} · context ${card.max_model_len} tokens`;
    $("key-banner").hidden = true;
    clearError();
  }

  // POST ``body`` to ``url`` with stream: true and call onChunk for each JSON event.
  async function streamEvents(url, body, onChunk) {
    const controller = new AbortController();
    state.controller = controller;
    const response = await fetch(url, {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (response.status === 401) {
      askForKey("The server refused the request: enter its API key.");
      throw new Error(await errorText(response));
    }
    if (!response.ok) throw new Error(await errorText(response));
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).trimStart()).join("\n");
        if (!data || data === "[DONE]") continue;  // keep-alive comments carry no data
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
        onChunk(chunk);
      }
    }
  }

  // ---- the request's fields from the settings panel -------------------------------------

  function numberField(id, label, integer) {
    const raw = $(id).value.trim();
    if (raw === "") return null;
    const value = Number(raw);
    if (!Number.isFinite(value) || (integer && !Number.isInteger(value))) {
      throw new InputError(`${label} must be ${integer ? "an integer" : "a number"}, got "${raw}"`);
    }
    return value;
  }

  function jsonField(id, label) {
    const raw = $(id).value.trim();
    if (raw === "") return null;
    try {
      return JSON.parse(raw);
    } catch (e) {
      throw new InputError(`${label} is not valid JSON: ${e.message}`);
    }
  }

  function requestFields(mode) {
    const fields = {};
    for (const [id, name, label, integer] of [
      ["temperature", "temperature", "Temperature", false],
      ["top-p", "top_p", "top_p", false],
      ["max-tokens", "max_tokens", "max_tokens", true],
      ["seed", "seed", "Seed", true],
    ]) {
      const value = numberField(id, label, integer);
      if (value !== null) fields[name] = value;
    }
    const stop = $("stop").value.split("\n").filter((s) => s.length > 0);
    if (stop.length) fields.stop = stop;
    const format = $("response-format").value;
    if (format === "json_object") fields.response_format = { type: "json_object" };
    if (format === "json_schema") {
      const schema = jsonField("json-schema", "The JSON schema");
      if (schema === null) throw new InputError("JSON schema mode needs a schema");
      fields.response_format = {
        type: "json_schema", json_schema: { name: "playground", schema },
      };
    }
    if (mode === "chat") {
      const tools = jsonField("tools", "The tool definitions");
      if (tools !== null) {
        if (!Array.isArray(tools)) throw new InputError("The tool definitions must be a JSON list");
        if (tools.length) {
          fields.tools = tools;
          fields.tool_choice = $("tool-choice").value;
        }
      }
    }
    return fields;
  }

  // ---- rendering ----------------------------------------------------------------------

  function element(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function addUserMessage(text) {
    $("empty-hint").hidden = true;
    const node = element("article", "message user");
    node.setAttribute("aria-label", "You");
    node.appendChild(element("div", "content", text));
    $("messages").appendChild(node);
    scrollDown();
  }

  function addAssistantMessage() {
    const node = element("article", "message assistant streaming");
    node.setAttribute("aria-label", "Assistant");
    node.dataset.testid = "assistant-message";
    const reasoning = element("details", "reasoning");
    reasoning.hidden = true;
    const summary = element("summary", "", "Reasoning");
    const reasoningText = element("div", "reasoning-text");
    reasoning.append(summary, reasoningText);
    const content = element("div", "content");
    const calls = element("div", "tool-calls");
    const stats = element("p", "stats", "…");
    stats.dataset.testid = "message-stats";
    node.append(reasoning, content, calls, stats);
    $("messages").appendChild(node);
    scrollDown();
    return { node, reasoning, summary, reasoningText, content, calls, stats };
  }

  function renderToolCalls(view, toolCalls) {
    view.calls.replaceChildren();
    for (const call of toolCalls) {
      const card = element("div", "tool-call");
      card.dataset.testid = "tool-call";
      card.appendChild(element("span", "tool-name", `${call.function.name || "…"}()`));
      let args = call.function.arguments;
      try {
        args = JSON.stringify(JSON.parse(args), null, 2);
      } catch (_) { /* still streaming, or not JSON: show as it is */ }
      card.appendChild(element("pre", "tool-args", args));
      view.calls.appendChild(card);
    }
  }

  function scrollDown() {
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
  }

  // "12 tokens · 35.1 tok/s · first token 0.21 s · stop"
  function statsLine(timing, usage, pieces, finish) {
    const parts = [];
    const tokens = usage ? usage.completion_tokens : pieces;
    parts.push(`${usage ? "" : "≈"}${tokens} token${tokens === 1 ? "" : "s"}`);
    if (usage) parts.push(`prompt ${usage.prompt_tokens}`);
    const end = timing.end || performance.now();
    if (timing.first !== null && tokens > 1 && end > timing.first) {
      parts.push(`${((tokens - 1) / ((end - timing.first) / 1000)).toFixed(1)} tok/s`);
    }
    if (timing.first !== null) {
      parts.push(`first token ${((timing.first - timing.start) / 1000).toFixed(2)} s`);
    }
    if (finish) parts.push(finish);
    return parts.join(" · ");
  }

  // ---- generation ---------------------------------------------------------------------

  async function sendChat() {
    const text = $("prompt").value;
    if (!text.trim()) return;
    const fields = requestFields("chat");
    $("prompt").value = "";
    state.messages.push({ role: "user", content: text });
    addUserMessage(text);
    const conversation = [];
    const system = $("system-prompt").value.trim();
    if (system) conversation.push({ role: "system", content: system });
    conversation.push(...state.messages);
    const body = {
      model: state.model, messages: conversation, stream: true,
      stream_options: { include_usage: true }, ...fields,
    };
    const view = addAssistantMessage();
    const reply = { content: "", reasoning: "", toolCalls: [] };
    const timing = { start: performance.now(), first: null, end: null };
    let usage = null;
    let pieces = 0;
    let finish = null;
    try {
      await streamEvents("/v1/chat/completions", body, (chunk) => {
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const delta = choice.delta || {};
          const reasoning = delta.reasoning_content || delta.reasoning;
          if (delta.content || reasoning || delta.tool_calls) {
            if (timing.first === null) timing.first = performance.now();
            pieces += 1;
          }
          if (reasoning) {
            reply.reasoning += reasoning;
            view.reasoning.hidden = false;
            view.reasoningText.textContent = reply.reasoning;
            view.summary.textContent = `Reasoning (${reply.reasoning.length} characters)`;
          }
          if (delta.content) {
            reply.content += delta.content;
            view.content.textContent = reply.content;
          }
          for (const call of delta.tool_calls || []) {
            const slot = reply.toolCalls[call.index || 0] ||= {
              id: "", type: "function", function: { name: "", arguments: "" },
            };
            if (call.id) slot.id = call.id;
            if (call.function && call.function.name) slot.function.name += call.function.name;
            if (call.function && call.function.arguments) {
              slot.function.arguments += call.function.arguments;
            }
            renderToolCalls(view, reply.toolCalls);
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
        view.stats.textContent = statsLine(timing, usage, pieces, null);
        scrollDown();
      });
    } catch (e) {
      finish = e.name === "AbortError" ? "stopped" : null;
      if (finish === null) {
        view.node.classList.add("failed");
        view.content.textContent = reply.content || "";
        view.node.appendChild(element("p", "message-error", e.message));
      }
    } finally {
      timing.end = performance.now();
      view.node.classList.remove("streaming");
      view.stats.textContent = statsLine(timing, usage, pieces, finish);
    }
    const message = { role: "assistant", content: reply.content };
    if (reply.toolCalls.length) message.tool_calls = reply.toolCalls.filter(Boolean);
    state.messages.push(message);
  }

  async function sendCompletion() {
    const box = $("completion-text");
    const prompt = box.value;
    if (!prompt) return;
    const fields = requestFields("completion");
    const body = {
      model: state.model, prompt, stream: true, stream_options: { include_usage: true },
      ...fields,
    };
    const timing = { start: performance.now(), first: null, end: null };
    let usage = null;
    let pieces = 0;
    let finish = null;
    box.readOnly = true;
    const stats = $("completion-stats");
    stats.textContent = "…";
    try {
      await streamEvents("/v1/completions", body, (chunk) => {
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          if (choice.text) {
            if (timing.first === null) timing.first = performance.now();
            pieces += 1;
            box.value += choice.text;
            box.scrollTop = box.scrollHeight;
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
        stats.textContent = statsLine(timing, usage, pieces, null);
      });
    } catch (e) {
      if (e.name === "AbortError") finish = "stopped";
      else showError(e.message);
    } finally {
      timing.end = performance.now();
      box.readOnly = false;
      stats.textContent = statsLine(timing, usage, pieces, finish);
    }
  }

  async function send() {
    if (state.controller) return;  // one generation at a time
    clearError();
    if (state.model === null) await loadModel();
    if (state.model === null) return;
    setBusy(true);
    try {
      if (mode() === "chat") await sendChat();
      else await sendCompletion();
    } catch (e) {
      showError(e.message);
    } finally {
      state.controller = null;
      setBusy(false);
    }
  }

  function stop() {
    if (state.controller) state.controller.abort();
  }

  // ---- page state ---------------------------------------------------------------------

  function mode() {
    return document.querySelector('input[name="mode"]:checked').value;
  }

  function applyMode() {
    const completion = mode() === "completion";
    document.body.classList.toggle("mode-completion", completion);
    $("messages").hidden = completion;
    $("completion-view").hidden = !completion;
    $("prompt").hidden = completion;
    $("send").textContent = completion ? "Generate" : "Send";
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop-button").hidden = !busy;
    $("new-chat").disabled = busy;
    if (!busy) (mode() === "chat" ? $("prompt") : $("completion-text")).focus();
  }

  function showError(message) {
    const banner = $("error-banner");
    banner.textContent = message;
    banner.hidden = false;
  }

  function clearError() {
    $("error-banner").hidden = true;
    $("error-banner").textContent = "";
  }

  function askForKey(message) {
    $("key-banner").hidden = false;
    if (message) showError(message);
    $("api-key").focus();
  }

  function remember() {
    const saved = {};
    for (const id of REMEMBERED) saved[id] = $(id).value;
    localStorage.setItem("vllmpy.settings", JSON.stringify(saved));
  }

  function restore() {
    let saved = {};
    try {
      saved = JSON.parse(localStorage.getItem("vllmpy.settings") || "{}") || {};
    } catch (_) { /* a broken entry: start from the defaults */ }
    for (const id of REMEMBERED) if (typeof saved[id] === "string") $(id).value = saved[id];
    $("json-schema").hidden = $("response-format").value !== "json_schema";
  }

  function newChat() {
    state.messages = [];
    $("messages").querySelectorAll(".message").forEach((m) => m.remove());
    $("empty-hint").hidden = false;
    $("prompt").focus();
  }

  // ---- wiring -------------------------------------------------------------------------

  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("completion-text").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape") stop();
  });
  $("stop-button").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  for (const radio of document.querySelectorAll('input[name="mode"]')) {
    radio.addEventListener("change", applyMode);
  }
  $("response-format").addEventListener("change", () => {
    $("json-schema").hidden = $("response-format").value !== "json_schema";
  });
  for (const id of REMEMBERED) $(id).addEventListener("change", remember);
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    state.apiKey = $("api-key").value.trim();
    sessionStorage.setItem(KEY_STORAGE, state.apiKey);
    loadModel();
  });

  restore();
  applyMode();
  loadModel();
  $("prompt").focus();
})();
