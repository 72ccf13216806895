//! OpenTelemetry traces, exported over OTLP/HTTP when `[telemetry]
//! otlp_endpoint` is set: one trace per request (`request`, with `auth`,
//! `route` (the router policy's decision), `upstream` (the proxied call)
//! and, for a local model, `queue`, `prefill` and `decode` under it), a
//! client's W3C `traceparent` adopted as the parent, and the upstream call's
//! own `traceparent` sent on.
//!
//! The request-path spans are `tracing` spans, turned into OpenTelemetry
//! spans by `tracing-opentelemetry`; the engine phases are made with their
//! real start and end times when the request ends (the engine thread
//! batches many requests and knows none of them as a span). With no
//! endpoint nothing is recorded: [`span`] is `Span::none()`, and no layer
//! or exporter exists.
//!
//! The SDK exports from a thread of its own; the HTTP call itself runs on
//! the server's runtime ([`OnRuntime`]), where hyper's connections live.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::HeaderMap;
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{Span as _, Tracer as _, TracerProvider as _};
use opentelemetry_http::hyper::HyperClient;
use opentelemetry_http::{HeaderExtractor, HttpClient, HttpError};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SdkTracer, SdkTracerProvider,
};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::config::TelemetryConfig;

/// Whether spans are recorded (an endpoint is configured).
static ENABLED: AtomicBool = AtomicBool::new(false);

pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// The exporting pipeline; [`Telemetry::shutdown`] sends what is left.
pub struct Telemetry {
    provider: SdkTracerProvider,
}

/// The `tracing` layer that turns the gateway's spans into OpenTelemetry's.
pub type Layer<S> = tracing_opentelemetry::OpenTelemetryLayer<S, SdkTracer>;

impl Telemetry {
    /// The pipeline of `config` (`None` without an endpoint) and its
    /// `tracing` layer; exports are sent from `runtime`.
    pub fn start<S>(
        config: &TelemetryConfig,
        runtime: tokio::runtime::Handle,
    ) -> Result<Option<(Telemetry, Layer<S>)>, String>
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        let Some(endpoint) = &config.otlp_endpoint else {
            return Ok(None);
        };
        let client = OnRuntime {
            client: HyperClient::with_default_connector(Duration::from_secs(10), None),
            runtime,
        };
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(client)
            .with_endpoint(format!("{}/v1/traces", endpoint.trim_end_matches('/')))
            .build()
            .map_err(|e| format!("[telemetry] cannot make the OTLP exporter: {e}"))?;
        let batch = BatchConfigBuilder::default()
            .with_scheduled_delay(Duration::from_millis(config.export_delay_ms))
            .build();
        let processor = BatchSpanProcessor::builder(exporter)
            .with_batch_config(batch)
            .build();
        let resource = opentelemetry_sdk::Resource::builder()
            .with_service_name(config.service_name.clone())
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_resource(resource)
            .build();
        let tracer = provider.tracer("mlxgate");
        opentelemetry::global::set_tracer_provider(provider.clone());
        ENABLED.store(true, Ordering::Relaxed);
        let layer = tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_tracked_inactivity(false);
        Ok(Some((Telemetry { provider }, layer)))
    }

    /// Exports the spans still waiting; call before the runtime stops.
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!(error = %e, "traces not all exported at shutdown");
        }
    }
}

/// The OTLP exporter's HTTP client: hyper's, each call spawned onto the
/// server's runtime (the SDK's export thread has none).
#[derive(Debug)]
struct OnRuntime {
    client: HyperClient,
    runtime: tokio::runtime::Handle,
}

#[async_trait::async_trait]
impl HttpClient for OnRuntime {
    async fn send_bytes(
        &self,
        request: http::Request<Bytes>,
    ) -> Result<http::Response<Bytes>, HttpError> {
        let client = self.client.clone();
        self.runtime
            .spawn(async move { client.send_bytes(request).await })
            .await
            .map_err(|e| -> HttpError { Box::new(e) })?
    }
}

/// A step of the request path that gets a span of its own.
#[derive(Debug, Clone, Copy)]
pub enum Step {
    /// Checking the API key.
    Auth,
    /// Deciding where the request goes (the router policy's call).
    Route,
    /// The call to an upstream, up to its answer's head.
    Upstream,
}

/// The span of `step`, a child of the current one; `Span::none()` (free)
/// while traces are off.
pub fn span(step: Step) -> tracing::Span {
    if !enabled() {
        return tracing::Span::none();
    }
    match step {
        Step::Auth => tracing::info_span!("auth"),
        Step::Route => tracing::info_span!("route"),
        Step::Upstream => tracing::info_span!("upstream", upstream = tracing::field::Empty),
    }
}

/// Makes the client's W3C `traceparent` (and `tracestate`), when sent, the
/// parent of the request's span.
pub fn adopt_parent(span: &tracing::Span, headers: &HeaderMap) {
    if !enabled() || !headers.contains_key("traceparent") {
        return;
    }
    let parent = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    let _ = span.set_parent(parent);
}

/// The `traceparent` that makes an outgoing call a child of `span`.
pub fn traceparent(span: &tracing::Span) -> Option<String> {
    if !enabled() {
        return None;
    }
    let mut fields = HashMap::new();
    TraceContextPropagator::new().inject_context(&span.context(), &mut fields);
    fields.remove("traceparent")
}

/// Records spans `(name, start, end)` under `parent`, with those times.
pub fn record_phases(parent: &tracing::Span, phases: &[(&'static str, Instant, Instant)]) {
    if !enabled() || phases.is_empty() {
        return;
    }
    let tracer = opentelemetry::global::tracer("mlxgate");
    let parent = parent.context();
    let (now, wall) = (Instant::now(), SystemTime::now());
    let at = |i: Instant| wall - now.saturating_duration_since(i);
    for &(name, start, end) in phases {
        let mut span = tracer
            .span_builder(name)
            .with_start_time(at(start))
            .start_with_context(&tracer, &parent);
        span.end_with_timestamp(at(end));
    }
}
