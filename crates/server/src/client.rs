//! A minimal HTTP/1.1 client with Server-Sent Events, for the load tester and the tests.
//!
//! One request per connection (`Connection: close`); bodies by `Content-Length`, chunked, or
//! until close. Loopback use only: [`loopback_addr`] refuses any other host.

use std::io;
use std::net::{IpAddr, SocketAddr};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// Largest body [`Response::bytes`] reads.
pub const MAX_BODY: usize = 64 << 20;

/// The socket address of an `http://host:port` URL whose host is a loopback address
/// (`127.0.0.0/8`, `[::1]`, `localhost`; no name is resolved). Anything else is an error: the
/// tools built on this client talk to a local server only.
pub fn loopback_addr(url: &str) -> io::Result<SocketAddr> {
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidInput, format!("{url}: {what}"));
    let rest = url.strip_prefix("http://").ok_or_else(|| bad("only http:// URLs are supported"))?;
    let hostport = rest.split('/').next().unwrap_or("");
    if hostport.is_empty() {
        return Err(bad("no host"));
    }
    let (host, port) = match hostport.rsplit_once(':') {
        Some((h, p)) if !h.is_empty() && !p.contains(']') => (h, p.parse::<u16>().map_err(|_| bad("bad port"))?),
        _ => (hostport, 80),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let ip: IpAddr = if host.eq_ignore_ascii_case("localhost") {
        IpAddr::from([127, 0, 0, 1])
    } else {
        host.parse().map_err(|_| bad("the host must be an IP address or localhost"))?
    };
    if !ip.is_loopback() {
        return Err(bad("not a loopback address; this tool only talks to a server on this machine (127.0.0.1)"));
    }
    let a = SocketAddr::new(ip, port);
    Ok(a)
}

enum Mode {
    Length(u64),
    Chunked { left: u64, done: bool },
    Close,
}

/// A response whose body has not been read yet.
pub struct Response {
    pub status: u16,
    /// Header names lower-cased.
    pub headers: Vec<(String, String)>,
    r: BufReader<TcpStream>,
    mode: Mode,
}

fn invalid(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

/// Sends `method path` with `body` (as `content_type`) to `addr` and reads the status line and
/// headers.
pub async fn request(addr: SocketAddr, method: &str, path: &str, body: Option<(&str, &[u8])>) -> io::Result<Response> {
    request_with(addr, method, path, body, &[]).await
}

/// [`request`] with more headers (`name`, `value`: no line breaks).
pub async fn request_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<(&str, &[u8])>,
    headers: &[(&str, &str)],
) -> io::Result<Response> {
    let mut s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nAccept: */*\r\n");
    for (k, v) in headers {
        if [k, v].iter().any(|x| x.contains(['\r', '\n'])) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("header {k:?} holds a line break")));
        }
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some((ct, b)) = body {
        head.push_str(&format!("Content-Type: {ct}\r\nContent-Length: {}\r\n", b.len()));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).await?;
    if let Some((_, b)) = body {
        s.write_all(b).await?;
    }
    s.flush().await?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).await?;
    let status: u16 =
        line.split_whitespace().nth(1).and_then(|c| c.parse().ok()).ok_or_else(|| invalid(format!("bad status line {line:?}")))?;
    let mut headers = Vec::new();
    loop {
        line.clear();
        if r.read_line(&mut line).await? == 0 {
            return Err(invalid("connection closed inside the headers"));
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
        if headers.len() > 200 {
            return Err(invalid("too many headers"));
        }
    }
    let get = |k: &str| headers.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    let mode = if get("transfer-encoding").is_some_and(|v| v.to_ascii_lowercase().contains("chunked")) {
        Mode::Chunked { left: 0, done: false }
    } else if let Some(n) = get("content-length").and_then(|v| v.parse().ok()) {
        Mode::Length(n)
    } else {
        Mode::Close
    };
    Ok(Response { status, headers, r, mode })
}

/// POSTs a JSON value.
pub async fn post_json(addr: SocketAddr, path: &str, body: &serde_json::Value) -> io::Result<Response> {
    post_json_with(addr, path, body, &[]).await
}

/// [`post_json`] with more headers.
pub async fn post_json_with(addr: SocketAddr, path: &str, body: &serde_json::Value, headers: &[(&str, &str)]) -> io::Result<Response> {
    request_with(addr, "POST", path, Some(("application/json", body.to_string().as_bytes())), headers).await
}

impl Response {
    /// A header's value (name in any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        let n = name.to_ascii_lowercase();
        self.headers.iter().find(|(k, _)| *k == n).map(|(_, v)| v.as_str())
    }

    /// The next piece of the body, or None at its end.
    pub async fn chunk(&mut self) -> io::Result<Option<Vec<u8>>> {
        let mut buf = vec![0u8; 16 << 10];
        match &mut self.mode {
            Mode::Length(0) => Ok(None),
            Mode::Length(left) => {
                let want = (*left).min(buf.len() as u64) as usize;
                let n = self.r.read(&mut buf[..want]).await?;
                if n == 0 {
                    return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "body shorter than Content-Length"));
                }
                *left -= n as u64;
                buf.truncate(n);
                Ok(Some(buf))
            }
            Mode::Close => {
                let n = self.r.read(&mut buf).await?;
                if n == 0 {
                    return Ok(None);
                }
                buf.truncate(n);
                Ok(Some(buf))
            }
            Mode::Chunked { done: true, .. } => Ok(None),
            Mode::Chunked { left, done } => {
                if *left == 0 {
                    let mut line = String::new();
                    if self.r.read_line(&mut line).await? == 0 {
                        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed inside a chunked body"));
                    }
                    let size = line.trim().split(';').next().unwrap_or("");
                    let size = u64::from_str_radix(size.trim(), 16).map_err(|_| invalid(format!("bad chunk size {line:?}")))?;
                    if size == 0 {
                        // Trailers, then the empty line.
                        loop {
                            line.clear();
                            if self.r.read_line(&mut line).await? == 0 || line.trim().is_empty() {
                                break;
                            }
                        }
                        *done = true;
                        return Ok(None);
                    }
                    *left = size;
                }
                let want = (*left).min(buf.len() as u64) as usize;
                let n = self.r.read(&mut buf[..want]).await?;
                if n == 0 {
                    return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed inside a chunk"));
                }
                *left -= n as u64;
                if *left == 0 {
                    let mut crlf = [0u8; 2];
                    self.r.read_exact(&mut crlf).await?;
                }
                buf.truncate(n);
                Ok(Some(buf))
            }
        }
    }

    /// The whole body (at most [`MAX_BODY`] bytes).
    pub async fn bytes(mut self) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        while let Some(c) = self.chunk().await? {
            out.extend_from_slice(&c);
            if out.len() > MAX_BODY {
                return Err(invalid("body too large"));
            }
        }
        Ok(out)
    }

    /// The whole body as text.
    pub async fn text(self) -> io::Result<String> {
        Ok(String::from_utf8_lossy(&self.bytes().await?).into_owned())
    }

    /// The whole body as JSON.
    pub async fn json(self) -> io::Result<serde_json::Value> {
        let b = self.bytes().await?;
        serde_json::from_slice(&b).map_err(|e| invalid(format!("body is not JSON ({e}): {}", String::from_utf8_lossy(&b))))
    }

    /// Reads the body as Server-Sent Events.
    pub fn events(self) -> Events {
        Events { resp: self, buf: Vec::new() }
    }
}

/// The `data:` payloads of an SSE body, one event at a time.
pub struct Events {
    resp: Response,
    buf: Vec<u8>,
}

impl Events {
    /// The next event's data (lines joined with `\n`), or None at the end of the body.
    pub async fn next(&mut self) -> io::Result<Option<String>> {
        loop {
            if let Some(end) = find_event_end(&self.buf) {
                let ev: Vec<u8> = self.buf.drain(..end.0).collect();
                self.buf.drain(..end.1);
                let text = String::from_utf8_lossy(&ev);
                let data: Vec<&str> =
                    text.lines().filter_map(|l| l.strip_prefix("data:").map(|d| d.strip_prefix(' ').unwrap_or(d))).collect();
                if data.is_empty() {
                    continue; // comment or keep-alive
                }
                return Ok(Some(data.join("\n")));
            }
            match self.resp.chunk().await? {
                Some(c) => self.buf.extend_from_slice(&c),
                None => {
                    if self.buf.iter().all(u8::is_ascii_whitespace) {
                        return Ok(None);
                    }
                    self.buf.extend_from_slice(b"\n\n");
                }
            }
        }
    }
}

/// (end of the event, length of the blank-line separator) of the first complete event.
fn find_event_end(b: &[u8]) -> Option<(usize, usize)> {
    let lf = b.windows(2).position(|w| w == b"\n\n").map(|p| (p, 2));
    let crlf = b.windows(4).position(|w| w == b"\r\n\r\n").map(|p| (p, 4));
    match (lf, crlf) {
        (Some(a), Some(c)) => Some(if a.0 <= c.0 { a } else { c }),
        (a, c) => a.or(c),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_only() {
        assert_eq!(loopback_addr("http://127.0.0.1:8080").expect("ok").port(), 8080);
        assert_eq!(loopback_addr("http://127.0.0.1:9/v1").expect("ok").port(), 9);
        assert!(loopback_addr("http://10.0.0.1:8080").is_err());
        assert!(loopback_addr("https://127.0.0.1:8080").is_err());
        assert!(loopback_addr("127.0.0.1:8080").is_err());
    }

    #[test]
    fn event_boundaries() {
        assert_eq!(find_event_end(b"data: x\n\ndata: y"), Some((7, 2)));
        assert_eq!(find_event_end(b"data: x\r\n\r\n"), Some((7, 4)));
        assert_eq!(find_event_end(b"data: x\n"), None);
    }
}
