//! OpenAI's error object: `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// An error answered to a client. `message` names the problem in one line; `param` names the
/// request field at fault when there is one.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// One-line description of what is wrong.
    pub message: String,
    /// OpenAI's `type` (`invalid_request_error`, `not_found_error`, `server_error`, …).
    pub kind: &'static str,
    /// The request field at fault (`messages`, `max_tokens`, `messages[1].content` …).
    pub param: Option<String>,
    /// A machine-readable code (`context_length_exceeded`, `model_not_found`, …).
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400 `invalid_request_error` about `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.into()),
            code: None,
        }
    }

    /// 400 `invalid_request_error` that concerns no single field.
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::BAD_REQUEST, message: message.into(), kind: "invalid_request_error", param: None, code: None }
    }

    /// Sets the machine-readable `code`.
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// Sets the HTTP status.
    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    /// 404 for an unknown route.
    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::NOT_FOUND, message: message.into(), kind: "not_found_error", param: None, code: None }
    }

    /// 503: the server cannot take the request now (queue full, engine stopped).
    pub fn unavailable(message: impl Into<String>, code: &'static str) -> Self {
        ApiError { status: StatusCode::SERVICE_UNAVAILABLE, message: message.into(), kind: "server_error", param: None, code: Some(code) }
    }

    /// 500: something failed inside the server.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::INTERNAL_SERVER_ERROR, message: message.into(), kind: "server_error", param: None, code: None }
    }

    /// The JSON body (`{"error": {...}}`).
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.body().to_string();
        (self.status, [(axum::http::header::CONTENT_TYPE, "application/json")], body).into_response()
    }
}
