//! The cluster token: every gRPC call carries `authorization: Bearer <token>`; the
//! worker refuses calls without it, naming what was wrong.

use std::path::PathBuf;

use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// Environment variable holding the token itself.
pub const TOKEN_ENV: &str = "MANTA_CLUSTER_TOKEN";
/// Environment variable naming a file that holds the token.
pub const TOKEN_FILE_ENV: &str = "MANTA_CLUSTER_TOKEN_FILE";

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("no cluster token: set {TOKEN_ENV} or {TOKEN_FILE_ENV} (a file holding the token)")]
    Missing,
    #[error("{TOKEN_FILE_ENV}={path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("the cluster token is empty or not printable ASCII (from {0})")]
    Invalid(String),
}

/// Reads the token from `MANTA_CLUSTER_TOKEN`, else from the file `MANTA_CLUSTER_TOKEN_FILE` names.
pub fn load_token() -> Result<String, AuthError> {
    let (token, source) = if let Ok(t) = std::env::var(TOKEN_ENV) {
        (t, TOKEN_ENV.to_string())
    } else if let Ok(path) = std::env::var(TOKEN_FILE_ENV) {
        let path = PathBuf::from(path);
        let text = std::fs::read_to_string(&path).map_err(|e| AuthError::File {
            path: path.clone(),
            message: e.to_string(),
        })?;
        (text, path.display().to_string())
    } else {
        return Err(AuthError::Missing);
    };
    let token = token.trim().to_string();
    if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(AuthError::Invalid(source));
    }
    Ok(token)
}

/// Client side: adds the bearer token to every request.
#[derive(Clone)]
pub struct BearerToken(MetadataValue<tonic::metadata::Ascii>);

impl BearerToken {
    pub fn new(token: &str) -> Result<Self, AuthError> {
        let value = format!("Bearer {token}")
            .parse()
            .map_err(|_| AuthError::Invalid("the token given".into()))?;
        Ok(Self(value))
    }
}

impl Interceptor for BearerToken {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        request
            .metadata_mut()
            .insert("authorization", self.0.clone());
        Ok(request)
    }
}

/// Server side: refuses calls whose bearer token is missing or wrong.
#[derive(Clone)]
pub struct CheckToken(String);

impl CheckToken {
    pub fn new(token: impl Into<String>) -> Self {
        Self(token.into())
    }
}

impl Interceptor for CheckToken {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(value) = request.metadata().get("authorization") else {
            return Err(Status::unauthenticated(format!(
                "missing cluster token: the call has no `authorization: Bearer <token>` metadata \
                 (set {TOKEN_ENV} or {TOKEN_FILE_ENV} on the caller)"
            )));
        };
        let given = value
            .to_str()
            .ok()
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        // Compare without an early exit so timing does not reveal a prefix.
        let expected = self.0.as_bytes();
        let same = given.len() == expected.len()
            && given
                .bytes()
                .zip(expected)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0;
        if !same {
            return Err(Status::unauthenticated(
                "wrong cluster token: the caller's token does not match this worker's",
            ));
        }
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_token_names_missing_and_wrong() {
        let mut check = CheckToken::new("s3cret");
        let err = check.call(Request::new(())).unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unauthenticated);
        assert!(err.message().contains("missing cluster token"), "{err}");
        let req = BearerToken::new("nope")
            .unwrap()
            .call(Request::new(()))
            .unwrap();
        let err = check.call(req).unwrap_err();
        assert!(err.message().contains("wrong cluster token"), "{err}");
        let req = BearerToken::new("s3cret")
            .unwrap()
            .call(Request::new(()))
            .unwrap();
        assert!(check.call(req).is_ok());
    }
}
