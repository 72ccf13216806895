//! One HTTP/1.1 connection to an upstream, driven by the task of the
//! request that holds it: [`H1::exchange`] writes the request and reads the
//! answer's head, [`H1::poll_data`] reads its body as it is polled.
//!
//! Why not hyper's client connection: it is built to run as a task of its
//! own, and reaches the request through channels (a request queue, an
//! answer callback, a body channel with its own wake-ups); replacing it
//! took ~9,000 of the ~59,000 instructions of a proxied request (callgrind,
//! BENCHMARKS.md "Serving threads and an in-place HTTP/1.1 upstream
//! client"). The message syntax is parsed by `httparse`, as hyper does;
//! what is left here is the framing of RFC 9112: the request head, the
//! answer's length (length, chunked, or until close) and when a connection
//! may carry another exchange. HTTP/2 upstreams keep hyper's client
//! (pool.rs).

use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes, BytesMut};
use http::header::{CONNECTION, CONTENT_LENGTH, TRANSFER_ENCODING};
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, Version};
use tokio::io::{AsyncRead, AsyncWriteExt, ReadBuf};

use super::pool::Stream;

/// Longest answer head read; a longer one is an error.
const MAX_HEAD: usize = 64 * 1024;
/// Most header lines in an answer head.
const MAX_HEADERS: usize = 128;
/// Longest chunk-size or trailer line.
const MAX_LINE: usize = 4096;
/// Room made in the buffer before each read.
const READ_SIZE: usize = 16 * 1024;

/// Why an exchange failed: the socket, or an answer that is not HTTP/1.1.
#[derive(Debug, thiserror::Error)]
pub enum H1Error {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("the connection closed {0}")]
    Closed(&'static str),
    #[error("invalid answer from the upstream: {0}")]
    Invalid(String),
}

fn invalid(what: impl Into<String>) -> H1Error {
    H1Error::Invalid(what.into())
}

/// How the body of the answer being read ends (RFC 9112 section 6.3).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Framing {
    /// Read whole (or no body at all).
    Done,
    /// This many bytes still to come.
    Length(u64),
    Chunked(Chunked),
    /// Everything until the upstream closes.
    UntilClose,
}

/// Where a chunked body's reading stands.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Chunked {
    /// At a chunk-size line.
    Size,
    /// In a chunk's data, this many bytes still to come.
    Data(u64),
    /// At the CRLF after a chunk's data.
    DataEnd,
    /// In the trailer section after the last chunk.
    Trailers,
}

/// A connection and what it has read but not yet handed on.
pub struct H1 {
    io: Stream,
    buf: BytesMut,
    framing: Framing,
    /// Whether the connection may carry another exchange once this answer
    /// is read whole: false from the start of an exchange until its head
    /// says so, and for good after an error or a close.
    keep_alive: bool,
}

impl H1 {
    pub fn new(io: Stream) -> H1 {
        H1 {
            io,
            buf: BytesMut::new(),
            framing: Framing::Done,
            keep_alive: true,
        }
    }

    /// Sends `req` (origin-form target, headers as given, `content-length`
    /// from the body) and reads the answer's head; the body is then read
    /// with [`H1::poll_data`]. Interim (1xx) answers are skipped.
    pub async fn exchange(&mut self, req: &Request<Bytes>) -> Result<Response<()>, H1Error> {
        if self.framing != Framing::Done || !self.keep_alive {
            return Err(H1Error::Closed(
                "before the request: the last exchange did not end cleanly",
            ));
        }
        self.keep_alive = false;
        let head = encode_head(req);
        self.io
            .write_all_buf(&mut head.as_slice().chain(&req.body()[..]))
            .await?;
        self.io.flush().await?;
        loop {
            if let Some(resp) = self.parse_head()? {
                if resp.status().is_informational() {
                    // Not reusable until the final answer's head says so.
                    self.keep_alive = false;
                    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
                        return Err(invalid("101 Switching Protocols was not asked for"));
                    }
                    continue;
                }
                return Ok(resp);
            }
            if self.buf.len() > MAX_HEAD {
                return Err(invalid(format!("answer head over {MAX_HEAD} bytes")));
            }
            if poll_fn(|cx| self.poll_fill(cx)).await? == 0 {
                return Err(H1Error::Closed("before an answer"));
            }
        }
    }

    /// The answer head at the start of the buffer, if it is all there;
    /// consumed, and the body's framing set.
    fn parse_head(&mut self) -> Result<Option<Response<()>>, H1Error> {
        let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut parsed = httparse::Response::new(&mut slots);
        let len = match parsed.parse(&self.buf) {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(e) => return Err(invalid(e.to_string())),
        };
        let code = parsed.code.unwrap_or_default();
        let status = StatusCode::from_u16(code).map_err(|_| invalid(format!("status {code}")))?;
        let mut headers = HeaderMap::with_capacity(parsed.headers.len());
        for h in parsed.headers.iter() {
            let name = HeaderName::from_bytes(h.name.as_bytes())
                .map_err(|_| invalid(format!("header name {:?}", h.name)))?;
            let value = HeaderValue::from_bytes(h.value)
                .map_err(|_| invalid(format!("value of header {name}")))?;
            headers.append(name, value);
        }
        let version = if parsed.version == Some(1) {
            Version::HTTP_11
        } else {
            Version::HTTP_10
        };
        self.buf.advance(len);
        self.framing = framing(status, &headers)?;
        self.keep_alive = version == Version::HTTP_11
            && self.framing != Framing::UntilClose
            && !tokens(&headers, &CONNECTION).any(|t| t.eq_ignore_ascii_case("close"));
        let mut resp = Response::new(());
        *resp.status_mut() = status;
        *resp.version_mut() = version;
        *resp.headers_mut() = headers;
        Ok(Some(resp))
    }

    /// Reads more from the socket into the buffer: the bytes read, 0 at EOF.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        self.buf.reserve(READ_SIZE);
        tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.buf)
    }

    /// The next piece of the answer's body: `None` once it is whole.
    pub fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, H1Error>>> {
        let polled = self.poll_data_inner(cx);
        if let Poll::Ready(Some(Err(_))) = &polled {
            self.keep_alive = false;
        }
        polled
    }

    fn poll_data_inner(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, H1Error>>> {
        loop {
            let step = match self.framing {
                Framing::Done => return Poll::Ready(None),
                Framing::Length(left) => self.take(left).map(|(data, left)| {
                    self.framing = match left {
                        0 => Framing::Done,
                        n => Framing::Length(n),
                    };
                    data
                }),
                Framing::UntilClose => self.take(u64::MAX).map(|(data, _)| data),
                Framing::Chunked(state) => match self.step_chunked(state) {
                    Ok(Some(data)) => Some(data),
                    Ok(None) if self.framing == Framing::Done => return Poll::Ready(None),
                    Ok(None) => None,
                    Err(e) => return Poll::Ready(Some(Err(e))),
                },
            };
            match step {
                Some(data) if !data.is_empty() => return Poll::Ready(Some(Ok(data))),
                Some(_) => continue,
                None => {}
            }
            match ready!(self.poll_fill(cx)) {
                Ok(0) if self.framing == Framing::UntilClose => {
                    self.framing = Framing::Done;
                    return Poll::Ready(None);
                }
                Ok(0) => {
                    return Poll::Ready(Some(Err(H1Error::Closed("in the middle of the answer"))));
                }
                Ok(_) => {}
                Err(e) => return Poll::Ready(Some(Err(e.into()))),
            }
        }
    }

    /// Up to `max` buffered body bytes and how many of `max` remain; `None`
    /// when nothing is buffered.
    fn take(&mut self, max: u64) -> Option<(Bytes, u64)> {
        if self.buf.is_empty() {
            return None;
        }
        let n = usize::try_from(max).map_or(self.buf.len(), |m| m.min(self.buf.len()));
        Some((self.buf.split_to(n).freeze(), max.saturating_sub(n as u64)))
    }

    /// Advances a chunked body as far as the buffer allows: chunk data when
    /// there is some, `None` when more must be read (or, with framing
    /// `Done`, at the end).
    fn step_chunked(&mut self, mut state: Chunked) -> Result<Option<Bytes>, H1Error> {
        loop {
            self.framing = Framing::Chunked(state);
            match state {
                Chunked::Size => {
                    let Some(line) = self.line()? else {
                        return Ok(None);
                    };
                    let size = chunk_size(&line)?;
                    state = if size == 0 {
                        Chunked::Trailers
                    } else {
                        Chunked::Data(size)
                    };
                }
                Chunked::Data(left) => {
                    let Some((data, left)) = self.take(left) else {
                        return Ok(None);
                    };
                    self.framing = Framing::Chunked(match left {
                        0 => Chunked::DataEnd,
                        n => Chunked::Data(n),
                    });
                    return Ok(Some(data));
                }
                Chunked::DataEnd => {
                    let Some(line) = self.line()? else {
                        return Ok(None);
                    };
                    if !line.is_empty() {
                        return Err(invalid("chunk data longer than its size"));
                    }
                    state = Chunked::Size;
                }
                Chunked::Trailers => {
                    let Some(line) = self.line()? else {
                        return Ok(None);
                    };
                    if line.is_empty() {
                        self.framing = Framing::Done;
                        return Ok(None);
                    }
                }
            }
        }
    }

    /// The next line in the buffer without its line end (CRLF, or a bare
    /// LF), consumed; `None` when it is not all there yet.
    fn line(&mut self) -> Result<Option<Bytes>, H1Error> {
        let Some(end) = self.buf.iter().position(|&b| b == b'\n') else {
            if self.buf.len() > MAX_LINE {
                return Err(invalid("chunked framing line too long"));
            }
            return Ok(None);
        };
        let mut line = self.buf.split_to(end + 1).freeze();
        line.truncate(end);
        if line.last() == Some(&b'\r') {
            line.truncate(end - 1);
        }
        Ok(Some(line))
    }

    /// Whether the answer is read whole.
    pub fn is_done(&self) -> bool {
        self.framing == Framing::Done
    }

    /// Body bytes still to come, when known.
    pub fn remaining(&self) -> Option<u64> {
        match self.framing {
            Framing::Done => Some(0),
            Framing::Length(n) => Some(n),
            Framing::Chunked(_) | Framing::UntilClose => None,
        }
    }

    /// Whether it can carry another exchange now: the last answer read
    /// whole, nothing more sent by the upstream, not closed by it (one
    /// poll with `cx` sees an EOF).
    pub fn reusable(&mut self, cx: &mut Context<'_>) -> bool {
        if !self.keep_alive || self.framing != Framing::Done || !self.buf.is_empty() {
            return false;
        }
        // Anything readable now (data, EOF, an error) ends its use.
        let mut byte = [0u8; 1];
        let mut probe = ReadBuf::new(&mut byte);
        if Pin::new(&mut self.io).poll_read(cx, &mut probe).is_ready() {
            self.keep_alive = false;
            return false;
        }
        true
    }
}

/// The request line and headers, `content-length` added.
fn encode_head(req: &Request<Bytes>) -> Vec<u8> {
    let target = req.uri().path_and_query().map_or("/", |p| p.as_str());
    let mut head = Vec::with_capacity(256);
    head.extend_from_slice(req.method().as_str().as_bytes());
    head.push(b' ');
    head.extend_from_slice(target.as_bytes());
    head.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in req.headers() {
        if name == CONTENT_LENGTH || name == TRANSFER_ENCODING {
            continue;
        }
        head.extend_from_slice(name.as_str().as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(value.as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    let body = req.body().len();
    if body > 0 || !matches!(*req.method(), http::Method::GET | http::Method::HEAD) {
        head.extend_from_slice(b"content-length: ");
        push_decimal(&mut head, body);
        head.extend_from_slice(b"\r\n");
    }
    head.extend_from_slice(b"\r\n");
    head
}

/// Appends `n` in decimal (no formatting machinery on every request).
fn push_decimal(out: &mut Vec<u8>, n: usize) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    let mut n = n;
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}

/// How an answer of `status` with `headers` ends (RFC 9112 section 6.3;
/// the gateway never sends HEAD).
fn framing(status: StatusCode, headers: &HeaderMap) -> Result<Framing, H1Error> {
    if status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return Ok(Framing::Done);
    }
    if headers.contains_key(TRANSFER_ENCODING) {
        // The last coding decides; anything but chunked runs to the close.
        let last = tokens(headers, &TRANSFER_ENCODING).last();
        return Ok(match last {
            Some(c) if c.eq_ignore_ascii_case("chunked") => Framing::Chunked(Chunked::Size),
            _ => Framing::UntilClose,
        });
    }
    let mut length = None;
    for v in headers.get_all(CONTENT_LENGTH) {
        for part in v.to_str().unwrap_or("x").split(',') {
            let part = part.trim();
            let n = (!part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()))
                .then(|| part.parse::<u64>().ok())
                .flatten()
                .ok_or_else(|| invalid(format!("content-length {part:?}")))?;
            if length.is_some_and(|l| l != n) {
                return Err(invalid("content-length values differ"));
            }
            length = Some(n);
        }
    }
    Ok(match length {
        Some(0) => Framing::Done,
        Some(n) => Framing::Length(n),
        None => Framing::UntilClose,
    })
}

/// The items of a comma-separated header, over all its lines, trimmed,
/// empty ones left out.
fn tokens<'h>(headers: &'h HeaderMap, name: &HeaderName) -> impl Iterator<Item = &'h str> {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|t| !t.is_empty())
}

/// A chunk-size line's size (extensions after `;` ignored).
fn chunk_size(line: &[u8]) -> Result<u64, H1Error> {
    let digits = line.split(|&b| b == b';').next().unwrap_or_default();
    let digits = digits.trim_ascii();
    if digits.is_empty() || digits.len() > 15 {
        return Err(invalid("chunk size"));
    }
    digits.iter().try_fold(0u64, |n, &b| {
        let d = (b as char)
            .to_digit(16)
            .ok_or_else(|| invalid("chunk size"))?;
        Ok(n * 16 + u64::from(d))
    })
}

#[cfg(test)]
mod tests {
    use std::task::Waker;
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use super::*;

    /// A connection to a server that reads one request (returned by the
    /// handle) and answers with `pieces`, flushed one at a time with a
    /// pause between them, then closes when `close`, or else waits.
    async fn upstream(
        pieces: &'static [&'static [u8]],
        close: bool,
    ) -> (H1, tokio::task::JoinHandle<Vec<u8>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut got = vec![0u8; 4096];
            let n = s.read(&mut got).await.unwrap();
            got.truncate(n);
            for p in pieces {
                s.write_all(p).await.unwrap();
                s.flush().await.unwrap();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if !close {
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
            got
        });
        let conn = H1::new(Stream::Plain(TcpStream::connect(addr).await.unwrap()));
        (conn, server)
    }

    fn post(body: &'static str) -> Request<Bytes> {
        let mut req = Request::new(Bytes::from_static(body.as_bytes()));
        *req.method_mut() = http::Method::POST;
        *req.uri_mut() = "/v1/chat/completions?x=1".parse().unwrap();
        req.headers_mut()
            .insert(http::header::HOST, HeaderValue::from_static("up:8000"));
        req
    }

    async fn body(conn: &mut H1) -> Result<Vec<u8>, H1Error> {
        let mut out = Vec::new();
        while let Some(piece) = poll_fn(|cx| conn.poll_data(cx)).await {
            out.extend_from_slice(&piece?);
        }
        Ok(out)
    }

    fn reusable(conn: &mut H1) -> bool {
        conn.reusable(&mut Context::from_waker(Waker::noop()))
    }

    #[tokio::test]
    async fn the_request_goes_out_with_its_length_and_a_sized_answer_is_read() {
        let (mut conn, server) = upstream(
            &[
                b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\nX-A: 1\r\n\r\nhello",
                b" world",
            ],
            false,
        )
        .await;
        let resp = conn.exchange(&post("abc")).await.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["x-a"], "1");
        assert_eq!(conn.remaining(), Some(11));
        assert_eq!(body(&mut conn).await.unwrap(), b"hello world");
        assert!(conn.is_done() && reusable(&mut conn));
        drop(server);
    }

    #[tokio::test]
    async fn the_request_bytes_are_exactly_these() {
        let (mut conn, server) = upstream(&[b"HTTP/1.1 204 No Content\r\n\r\n"], true).await;
        let resp = conn.exchange(&post("abc")).await.unwrap();
        assert_eq!(resp.status(), 204);
        assert_eq!(body(&mut conn).await.unwrap(), b"");
        let sent = server.await.unwrap();
        assert_eq!(
            String::from_utf8(sent).unwrap(),
            "POST /v1/chat/completions?x=1 HTTP/1.1\r\nhost: up:8000\r\ncontent-length: 3\r\n\r\nabc"
        );
    }

    #[tokio::test]
    async fn chunked_answers_are_decoded_across_reads_with_extensions_and_trailers() {
        let (mut conn, _server) = upstream(
            &[
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhel",
                b"lo\r\n6\r",
                b"\n world\r\n0\r\nx-trailer: 1\r\n",
                b"\r\n",
            ],
            false,
        )
        .await;
        conn.exchange(&post("{}")).await.unwrap();
        assert_eq!(conn.remaining(), None);
        assert_eq!(body(&mut conn).await.unwrap(), b"hello world");
        assert!(conn.is_done() && reusable(&mut conn));
    }

    #[tokio::test]
    async fn interim_answers_are_skipped() {
        let (mut conn, _server) = upstream(
            &[b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok"],
            false,
        )
        .await;
        assert_eq!(conn.exchange(&post("{}")).await.unwrap().status(), 201);
        assert_eq!(body(&mut conn).await.unwrap(), b"ok");
    }

    #[tokio::test]
    async fn an_answer_without_a_length_runs_to_the_close_and_ends_the_connection() {
        let (mut conn, _server) = upstream(&[b"HTTP/1.1 200 OK\r\n\r\nall of", b" it"], true).await;
        conn.exchange(&post("{}")).await.unwrap();
        assert_eq!(body(&mut conn).await.unwrap(), b"all of it");
        assert!(!reusable(&mut conn));
    }

    #[tokio::test]
    async fn connection_close_and_http_1_0_are_not_reused() {
        let answers: [&'static [&'static [u8]]; 2] = [
            &[b"HTTP/1.1 200 OK\r\nConnection: close\r\ncontent-length: 1\r\n\r\nx"],
            &[b"HTTP/1.0 200 OK\r\ncontent-length: 1\r\n\r\nx"],
        ];
        for answer in answers {
            let (mut conn, _server) = upstream(answer, false).await;
            conn.exchange(&post("{}")).await.unwrap();
            assert_eq!(body(&mut conn).await.unwrap(), b"x");
            assert!(!reusable(&mut conn));
        }
    }

    #[tokio::test]
    async fn bad_answers_are_errors_and_the_connection_is_not_reused() {
        let cases: [(&'static [&'static [u8]], bool); 5] = [
            (&[b"not http at all\r\n\r\n"], false),
            (
                &[b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nab"],
                false,
            ),
            (&[b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n"], false),
            (
                &[b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nshort"],
                true,
            ),
            (
                &[b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"],
                false,
            ),
        ];
        for (pieces, close) in cases {
            let (mut conn, _server) = upstream(pieces, close).await;
            let failed = match conn.exchange(&post("{}")).await {
                Err(_) => true,
                Ok(_) => body(&mut conn).await.is_err(),
            };
            assert!(failed, "{:?}", String::from_utf8_lossy(pieces[0]));
            assert!(!reusable(&mut conn));
        }
    }

    #[tokio::test]
    async fn a_closed_connection_before_the_answer_is_an_error() {
        let (mut conn, _server) = upstream(&[], true).await;
        let e = conn.exchange(&post("{}")).await.unwrap_err();
        assert!(e.to_string().contains("before an answer"), "{e}");
    }
}
