// sandboxq dashboard: live updates over server-sent events, with a plain refresh as the
// fallback. One EventSource per page; at most one page refresh in flight and at most one
// every REFRESH_MS, so a busy queue cannot make a page left open for hours pile up
// requests, timers or memory. The overview and workers pages (data-poll) also refresh
// every REFRESH_MS, and so does any page while it shows the outage banner. Everything
// from the server is set as text, never as HTML built here (the fetched page's <main> is
// server-escaped HTML).
"use strict";
(function () {
  var REFRESH_MS = 2000;
  var FALLBACK_MS = 20000;
  var body = document.body;
  var live = document.getElementById("live");
  var pending = null;
  var inFlight = false;
  var lastRefresh = 0;
  var fallback = null;
  var missed = false; // an event came while a refresh was in flight: its page may predate it
  var lastProgress = null;
  var outage = false; // the stream said the backend cannot be read, and not yet that it can

  function say(text) { if (live) { live.textContent = text; } }
  // Bidirectional overrides shown as their escapes, as the server's pages show them: one
  // in a progress message would reverse what follows it on the page.
  var BIDI = /[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/g;
  function visible(text) {
    return String(text).replace(BIDI, function (c) {
      return "\\u" + ("000" + c.charCodeAt(0).toString(16)).slice(-4);
    });
  }

  function refresh() {
    pending = null;
    if (inFlight) { schedule(); return; }
    inFlight = true;
    missed = false;
    lastRefresh = Date.now();
    fetch(window.location.href, { credentials: "same-origin", cache: "no-store" })
      // a 503 is the outage page: its banner replaces what would otherwise look current
      .then(function (r) { return r.ok || r.status === 503 ? r.text() : Promise.reject(r.status); })
      .then(function (text) {
        var doc = new DOMParser().parseFromString(text, "text/html");
        var fresh = doc.getElementById("main");
        var main = document.getElementById("main");
        if (fresh && main) { main.replaceWith(fresh); }
        wire(document);
        if (missed && lastProgress) { progress(lastProgress); }
      })
      .catch(function () { missed = true; /* tried again below */ })
      .then(function () {
        inFlight = false;
        if (missed) { schedule(); }
      });
  }

  function schedule() {
    if (pending !== null) { return; }
    var wait = Math.max(0, lastRefresh + REFRESH_MS - Date.now());
    pending = window.setTimeout(refresh, wait);
  }

  function progress(data) {
    var bar = document.getElementById("progress");
    var text = document.getElementById("progress-text");
    var message = document.getElementById("progress-message");
    var fraction = parseFloat(data.fraction);
    if (bar && !isNaN(fraction)) { bar.value = fraction; }
    if (text && !isNaN(fraction)) { text.textContent = Math.round(fraction * 100) + "%"; }
    if (message) { message.textContent = visible(data.message || ""); }
  }

  function startFallback() {
    if (fallback !== null) { return; }
    say("refreshing every " + FALLBACK_MS / 1000 + " s");
    fallback = window.setInterval(refresh, FALLBACK_MS);
  }

  function stopFallback() {
    if (fallback !== null) { window.clearInterval(fallback); fallback = null; }
  }

  function connect() {
    var url = body.getAttribute("data-events");
    if (!url) { return; }
    if (!window.EventSource) { startFallback(); return; }
    var source = new EventSource(url);
    source.onopen = function () { stopFallback(); say("live"); };
    source.onerror = function () {
      // EventSource reconnects by itself; until it does, refresh now and then
      if (source.readyState === EventSource.CLOSED) { startFallback(); } else { say("reconnecting"); }
    };
    source.addEventListener("job", function (e) {
      var message;
      try { message = JSON.parse(e.data); } catch (err) { return; }
      if (inFlight) { missed = true; }
      if (body.getAttribute("data-page") === "job") {
        if (message.job !== body.getAttribute("data-job")) { return; }
        if (message.kind === "progress") {
          lastProgress = message.data || {};
          progress(lastProgress);
          return;
        }
      }
      schedule();
    });
    // the backend went away or came back: the page's next read shows which (a 503 is
    // the outage banner); pages that refresh only on events learn of it this way
    source.addEventListener("backend", function (e) {
      var message;
      try { message = JSON.parse(e.data); } catch (err) { return; }
      outage = message.kind === "outage";
      say(outage ? "backend unreachable" : "live");
      schedule();
    });
  }

  function wire(root) {
    var forms = root.querySelectorAll("form[data-confirm]");
    for (var i = 0; i < forms.length; i++) {
      if (forms[i].getAttribute("data-wired")) { continue; }
      forms[i].setAttribute("data-wired", "1");
      forms[i].addEventListener("submit", function (e) {
        if (!window.confirm(this.getAttribute("data-confirm"))) { e.preventDefault(); }
      });
    }
  }

  wire(document);
  connect();
  // pages that list queues or workers re-read themselves every REFRESH_MS whether or not
  // an event came: a new queue or an idle new worker sends none; so does any page while
  // it shows the outage banner or its stream says the backend is down (the page's own
  // read may succeed meanwhile, and the stream says nothing more until it changes)
  window.setInterval(function () {
    if (body.getAttribute("data-poll") || outage || document.getElementById("outage")) {
      schedule();
    }
  }, REFRESH_MS);
})();
