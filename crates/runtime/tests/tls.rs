//! TLS on the cluster gRPC against an in-process worker daemon: a client that trusts
//! the cluster CA (and carries the token) is served; a plaintext client, a client
//! trusting another CA and a client without the right token are refused, each with an
//! error that says why. Certificates are made here with rcgen.

use std::time::Duration;

use manta_runtime::{serve_with_tls, ClientTls, ServerTls, WorkerClient, WorkerDaemon};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use tokio::sync::oneshot;

const TOKEN: &str = "tls-test-token";
const LIMIT: Duration = Duration::from_secs(5);

/// A CA: its PEM certificate and the issuer that signs with it.
fn new_ca(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
}

/// A server certificate for `localhost` and 127.0.0.1, signed by `ca`: (cert PEM, key PEM).
fn server_cert(ca: &CertifiedIssuer<'static, KeyPair>) -> (String, String) {
    let params =
        CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, ca).unwrap();
    (cert.pem(), key.serialize_pem())
}

/// Starts a TLS worker on a free port; returns its `host:port` port and a stopper.
async fn start_tls_worker(tls: ServerTls) -> (u16, oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(async move {
        let stop = async {
            let _ = rx.await;
        };
        serve_with_tls(
            WorkerDaemon::new(vec![]),
            listener,
            TOKEN.into(),
            Some(tls),
            stop,
        )
        .await
        .unwrap();
    });
    (port, tx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_worker_serves_trusted_clients_and_refuses_the_rest() {
    let ca = new_ca("manta test CA");
    let (cert, key) = server_cert(&ca);
    let dir = tempfile::tempdir().unwrap();
    let (cert_path, key_path, ca_path) = (
        dir.path().join("cert.pem"),
        dir.path().join("key.pem"),
        dir.path().join("ca.pem"),
    );
    std::fs::write(&cert_path, &cert).unwrap();
    std::fs::write(&key_path, &key).unwrap();
    std::fs::write(&ca_path, ca.pem()).unwrap();
    let server_tls = ServerTls::from_files(&cert_path, &key_path).unwrap();
    let (port, stop) = start_tls_worker(server_tls).await;

    // Trusted CA + token, by IP (the certificate names 127.0.0.1) and by host name.
    let trusted = ClientTls::from_file("cluster.tls_ca", &ca_path, None).unwrap();
    let client =
        WorkerClient::connect(&format!("127.0.0.1:{port}"), TOKEN, Some(&trusted)).unwrap();
    let resources = client.describe(LIMIT).await.unwrap();
    assert!(resources.cpus >= 1);
    let reply = client.heartbeat(7, LIMIT).await.unwrap();
    assert_eq!(reply.sequence, 7);
    let by_name = WorkerClient::connect(&format!("localhost:{port}"), TOKEN, Some(&trusted))
        .unwrap()
        .heartbeat(8, LIMIT)
        .await
        .unwrap();
    assert_eq!(by_name.sequence, 8);

    // A domain override the certificate does not name fails verification.
    let wrong_name =
        ClientTls::from_file("cluster.tls_ca", &ca_path, Some("elsewhere".into())).unwrap();
    let err = WorkerClient::connect(&format!("127.0.0.1:{port}"), TOKEN, Some(&wrong_name))
        .unwrap()
        .heartbeat(1, LIMIT)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("elsewhere") || err.contains("NotValidForName"),
        "{err}"
    );

    // TLS is not a substitute for the token.
    let err = WorkerClient::connect(&format!("127.0.0.1:{port}"), "wrong", Some(&trusted))
        .unwrap()
        .describe(LIMIT)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("wrong cluster token"), "{err}");

    // Plaintext against a TLS worker.
    let err = WorkerClient::new(&format!("127.0.0.1:{port}"), TOKEN)
        .unwrap()
        .describe(LIMIT)
        .await
        .unwrap_err()
        .to_string();
    eprintln!("plaintext: {err}");
    assert!(err.contains(&format!("127.0.0.1:{port}")), "{err}");
    assert!(err.contains("TLS"), "{err}");

    // A client trusting another CA.
    let other_ca = new_ca("some other CA");
    let untrusted = ClientTls::from_pem(other_ca.pem(), None);
    let err = WorkerClient::connect(&format!("127.0.0.1:{port}"), TOKEN, Some(&untrusted))
        .unwrap()
        .describe(LIMIT)
        .await
        .unwrap_err()
        .to_string();
    eprintln!("wrong CA: {err}");
    assert!(
        err.contains("UnknownIssuer") || err.contains("unknown issuer"),
        "{err}"
    );

    let _ = stop.send(());

    // TLS against a plaintext worker.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let plain_port = listener.local_addr().unwrap().port();
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(async move {
        let stop = async {
            let _ = rx.await;
        };
        manta_runtime::serve(WorkerDaemon::new(vec![]), listener, TOKEN.into(), stop)
            .await
            .unwrap();
    });
    let err = WorkerClient::connect(&format!("127.0.0.1:{plain_port}"), TOKEN, Some(&trusted))
        .unwrap()
        .describe(LIMIT)
        .await
        .unwrap_err()
        .to_string();
    eprintln!("TLS to plaintext: {err}");
    assert!(err.contains("serving plaintext"), "{err}");
    let _ = tx.send(());
}

#[test]
fn bad_tls_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.pem");
    let err = ServerTls::from_files(&missing, &missing)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("--tls-cert") && err.contains("nope.pem"),
        "{err}"
    );

    let ca = new_ca("ca");
    let (cert, key) = server_cert(&ca);
    let (cert_path, key_path, junk) = (
        dir.path().join("cert.pem"),
        dir.path().join("key.pem"),
        dir.path().join("junk.pem"),
    );
    std::fs::write(&cert_path, &cert).unwrap();
    std::fs::write(&key_path, &key).unwrap();
    std::fs::write(&junk, "hello").unwrap();
    let err = ServerTls::from_files(&cert_path, &junk)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("--tls-key") && err.contains("junk.pem"),
        "{err}"
    );
    // A key that is not the certificate's.
    let other_key = dir.path().join("other-key.pem");
    std::fs::write(&other_key, KeyPair::generate().unwrap().serialize_pem()).unwrap();
    let err = ServerTls::from_files(&cert_path, &other_key)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("other-key.pem"), "{err}");

    let err = ClientTls::from_file("cluster.tls_ca", &junk, None)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("cluster.tls_ca") && err.contains("junk.pem"),
        "{err}"
    );
}
