// The console shell: who is signed in (checked against /console/session),
// the hash routes, the left nav filtered by the key's scopes, and a last
// line of defence against blank pages (error boundary + global banner).

import { Component, render } from 'preact';
import { useEffect, useState } from 'preact/hooks';
import { api, getKey, setKey } from './api.js';
import { html, ErrorBanner, Card, can } from './ui.js';
import { ChatPage } from './chat.js';
import { JobsPage, JobPage } from './jobs.js';
import { PoliciesPage } from './policies.js';
import { ResourcesPage } from './resources.js';
import { MetricsPage } from './metrics.js';

/** Pages in nav order, each with the scope its APIs need. */
const PAGES = [
  { id: 'chat', title: 'Chat', scope: 'infer', view: ChatPage },
  { id: 'jobs', title: 'Jobs', scope: 'jobs', view: JobsPage },
  { id: 'policies', title: 'Policies', scope: 'admin', view: PoliciesPage },
  { id: 'resources', title: 'Resources', scope: 'infer', view: ResourcesPage },
  { id: 'metrics', title: 'Metrics', scope: 'admin', view: MetricsPage },
];

function parseHash() {
  const parts = (location.hash || '').replace(/^#\/?/, '').split('/').filter(Boolean).map(decodeURIComponent);
  return { page: parts[0] || '', arg: parts[1] || null };
}

function useHashRoute() {
  const [route, setRoute] = useState(parseHash);
  useEffect(() => {
    const on = () => setRoute(parseHash());
    window.addEventListener('hashchange', on);
    return () => window.removeEventListener('hashchange', on);
  }, []);
  return route;
}

/** Catches render errors of one page so the shell and nav stay usable. */
class Boundary extends Component {
  constructor() {
    super();
    this.state = { error: null };
  }
  componentDidCatch(error) {
    this.setState({ error });
  }
  render() {
    if (this.state.error) {
      return html`<${ErrorBanner} error=${{ message: `This page failed: ${this.state.error.message || this.state.error}` }} />
        <button onClick=${() => this.setState({ error: null })}>Try again</button>`;
    }
    return this.props.children;
  }
}

function SignIn({ onSignedIn, notice }) {
  const [key, setKeyText] = useState('');
  const [error, setError] = useState(null);
  const [busy, setBusy] = useState(false);
  async function submit(e) {
    e.preventDefault();
    const k = key.trim();
    if (!k) {
      setError({ message: 'Enter an API key.' });
      return;
    }
    setBusy(true);
    setError(null);
    try {
      const session = await api('/console/session', { key: k });
      setKey(k);
      onSignedIn(session);
    } catch (err) {
      setError(err);
    } finally {
      setBusy(false);
    }
  }
  return html`<div class="signin" data-testid="signin">
    <section class="card">
      <h1>mlxgate console</h1>
      <p class="muted">Sign in with an API key. It stays in this tab only (sessionStorage) and is sent as a Bearer token.</p>
      ${notice ? html`<div class="banner info" data-testid="signin-notice"><div class="msg">${notice}</div></div>` : null}
      <${ErrorBanner} error=${error} testid="signin-error" />
      <form class="stack" onSubmit=${submit} data-testid="signin-form">
        <label class="field"><span class="name">API key</span>
          <input type="password" autocomplete="current-password" value=${key} data-testid="signin-key"
            onInput=${(e) => setKeyText(e.currentTarget.value)} autofocus />
        </label>
        <div class="row"><button class="primary" type="submit" disabled=${busy} data-testid="signin-submit">
          ${busy ? 'Checking…' : 'Sign in'}</button></div>
      </form>
    </section>
  </div>`;
}

function Nav({ session, route, onSignOut }) {
  const pages = PAGES.filter((p) => can(session, p.scope));
  return html`<nav class="nav" data-testid="nav">
    <div class="brand">mlxgate <span>console</span></div>
    ${pages.map(
      (p) => html`<a href=${`#/${p.id}`} class=${route.page === p.id ? 'active' : ''} data-testid=${`nav-${p.id}`}>${p.title}</a>`,
    )}
    <div class="spacer"></div>
    <div class="who" data-testid="session-info">
      <div>key <b data-testid="session-key-id">${session.key_id}</b></div>
      ${session.tenant ? html`<div>tenant <b>${session.tenant}</b></div>` : null}
      <div class="scopes">${(session.scopes || []).map((s) => html`<span class="badge">${s}</span>`)}</div>
      ${session.keys_configured === false
        ? html`<div class="small">No API keys are configured: open inference only.</div>`
        : html`<button onClick=${onSignOut} data-testid="signout">Sign out</button>`}
    </div>
  </nav>`;
}

function NotAllowed({ page }) {
  return html`<${Card} title=${page.title} testid="not-allowed">
    <p>This page is not allowed for this key: it needs the <code>${page.scope}</code> scope.</p>
  </${Card}>`;
}

function App() {
  // phase: checking -> signin | ready
  const [phase, setPhase] = useState('checking');
  const [session, setSession] = useState(null);
  const [notice, setNotice] = useState(null);
  const [fatal, setFatal] = useState(null);
  const route = useHashRoute();

  async function check() {
    const key = getKey();
    try {
      // Without a stored key this asks whether keys are configured at all
      // (200 anonymous when not); it is the only request made signed out.
      const s = await api('/console/session', { key });
      setSession(s);
      setPhase('ready');
    } catch (err) {
      if (key && err.status === 401) setNotice(`The stored key was refused: ${err.message}`);
      else if (err.status !== 401) setFatal(err);
      setKey('');
      setSession(null);
      setPhase('signin');
    }
  }

  useEffect(() => {
    check();
    const unauthorized = (e) => {
      setKey('');
      setSession(null);
      setNotice(`Signed out: ${e.detail}`);
      setPhase('signin');
    };
    const onError = (e) => {
      // Browsers report a ResizeObserver callback that resized again as an
      // error event; nothing failed (the charts just redraw next frame).
      if (String(e.message || '').startsWith('ResizeObserver loop')) return;
      setFatal({ message: `Unexpected error: ${e.message || e.reason || e}` });
    };
    const onRejection = (e) => {
      const r = e.reason;
      if (r && r.name === 'AbortError') return;
      setFatal({ message: `Unexpected error: ${r && r.message ? r.message : r}` });
    };
    window.addEventListener('mlxgate:unauthorized', unauthorized);
    window.addEventListener('error', onError);
    window.addEventListener('unhandledrejection', onRejection);
    return () => {
      window.removeEventListener('mlxgate:unauthorized', unauthorized);
      window.removeEventListener('error', onError);
      window.removeEventListener('unhandledrejection', onRejection);
    };
  }, []);

  function signOut() {
    setKey('');
    setSession(null);
    setNotice(null);
    setFatal(null);
    setPhase('signin');
    location.hash = '';
  }

  if (phase === 'checking') return html`<p class="boot">Checking the session…</p>`;
  if (phase === 'signin') {
    return html`${fatal ? html`<div style="padding: 12px"><${ErrorBanner} error=${fatal} /></div>` : null}
      <${SignIn} notice=${notice} onSignedIn=${(s) => { setSession(s); setNotice(null); setFatal(null); setPhase('ready'); }} />`;
  }

  const allowed = PAGES.filter((p) => can(session, p.scope));
  const page = PAGES.find((p) => p.id === route.page);
  let body;
  if (!page) {
    // Unknown or empty route: the first page this key may use.
    const first = allowed[0];
    if (first) {
      location.replace(`#/${first.id}`);
      body = null;
    } else {
      body = html`<${Card} title="Nothing to show" testid="not-allowed"><p>This key has no scope the console uses.</p></${Card}>`;
    }
  } else if (!can(session, page.scope)) {
    body = html`<${NotAllowed} page=${page} />`;
  } else if (page.id === 'jobs' && route.arg) {
    body = html`<${JobPage} key=${`job-${route.arg}`} id=${route.arg} session=${session} />`;
  } else {
    const View = page.view;
    body = html`<${View} key=${page.id} session=${session} />`;
  }
  return html`<div class="shell">
    <${Nav} session=${session} route=${route} onSignOut=${signOut} />
    <main data-testid=${`page-${route.page || 'none'}`}>
      <${ErrorBanner} error=${fatal} onClose=${() => setFatal(null)} testid="global-error" />
      <${Boundary} key=${`${route.page}/${route.arg || ''}`}>${body}</${Boundary}>
    </main>
  </div>`;
}

render(html`<${App} />`, document.getElementById('app'));
