// The coordinator's REST API as the dashboard calls it: the token, the requests, the
// job paths. The contract is client/hsx/wire.py.

// The states of a job that has ended.
export const FINISHED = new Set(["succeeded", "failed", "cancelled"]);

// ---------------------------------------------------------------- API token
// A server with HSX_API_TOKEN needs it on every /v1 call. The page takes it from
// ?token= once, keeps it in localStorage, and drops it from the address bar so it
// does not end up in screenshots or shared links.
const token = (() => {
  const url = new URL(window.location.href);
  const fromUrl = url.searchParams.get("token");
  try {
    if (fromUrl) {
      localStorage.setItem("hsx.token", fromUrl);
      url.searchParams.delete("token");
      history.replaceState(null, "", url.pathname + url.search + url.hash);
    }
    return fromUrl || localStorage.getItem("hsx.token") || "";
  } catch (_) {
    return fromUrl || "";
  }
})();

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export async function api(path, options = {}) {
  const headers = { Accept: "application/json", ...(options.headers || {}) };
  if (token) headers.Authorization = `Bearer ${token}`;
  const resp = await fetch(path, { ...options, headers });
  const text = await resp.text();
  let body = null;
  try {
    body = text ? JSON.parse(text) : null;
  } catch (_) {
    body = null;
  }
  if (!resp.ok) {
    // ErrorBody {type, message, field}; FastAPI's own errors carry {detail}.
    let message = `${resp.status} ${resp.statusText}`;
    if (body && typeof body.message === "string") message = body.message;
    else if (body && typeof body.detail === "string") message = body.detail;
    throw new ApiError(resp.status, message);
  }
  return body;
}

// Paths are relative to the page, so the dashboard also works behind a path prefix
// (a reverse proxy serving the coordinator at /hsx/, say).
export const jobPath = (id) => `v1/jobs/${encodeURIComponent(id)}`;

export function eventsUrl(id) {
  // EventSource cannot send headers: the token travels as a query parameter.
  const url = `${jobPath(id)}/events`;
  return token ? `${url}?access_token=${encodeURIComponent(token)}` : url;
}
