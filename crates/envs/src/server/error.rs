//! HTTP errors in the SDK server's shape: a status and `{"detail": message}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::env::EnvError;

/// An error answer; `detail` reads like the FastAPI server's so clients can match on it.
#[derive(Debug)]
pub(crate) struct ApiError {
    pub status: StatusCode,
    pub detail: String,
}

impl ApiError {
    pub fn new(status: StatusCode, detail: impl Into<String>) -> Self {
        Self {
            status,
            detail: detail.into(),
        }
    }

    pub fn bad_request(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, detail)
    }

    pub fn not_found(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, detail)
    }

    /// A body that does not match the endpoint's schema (FastAPI answers 422).
    pub fn unprocessable(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, detail)
    }
}

impl From<EnvError> for ApiError {
    fn from(err: EnvError) -> Self {
        match err {
            EnvError::UnknownSplit(_) => ApiError::bad_request("Invalid split"),
            EnvError::IndexOutOfRange { .. } => {
                ApiError::bad_request(format!("Invalid index: {err}"))
            }
            EnvError::ListingNotSupported => ApiError::bad_request(err.to_string()),
            EnvError::InvalidTask(_) => ApiError::unprocessable(err.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (
            self.status,
            Json(serde_json::json!({ "detail": self.detail })),
        )
            .into_response()
    }
}
