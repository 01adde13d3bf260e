//! The control plane across hosts (issue 16): mutual TLS, with certificates
//! generated here at test time. A client is who its certificate names; one
//! with no certificate is `unauthenticated`, one with a name the config does
//! not know is `forbidden`, one signed by another CA never completes the
//! handshake; and a client refuses a daemon its CA did not sign.

use std::path::{Path, PathBuf};
use std::process::Command;

use pdstor::client::{Client, ClientError};
use pdstor::store::Layout;
use pdstor_tests::{Daemon, pdstor_bin};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair};

const SLOT: u64 = 1 << 20;

fn layout() -> Layout {
    Layout {
        model_id: "tls".into(),
        dtype: "bf16".into(),
        layers: 1,
        kv_heads: 1,
        head_dim: 64,
        chunk_tokens: 16,
        kv_format: "pdstor-tls".into(),
    }
}

/// A certificate authority that writes what it signs into `dir`.
struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
    pem: PathBuf,
}

impl Ca {
    fn new(dir: &Path, name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().expect("a CA key")).expect("a CA");
        let pem = dir.join(format!("{name}.pem"));
        std::fs::write(&pem, issuer.pem()).expect("writing the CA");
        Ca { issuer, pem }
    }

    /// A leaf certificate for `cn` (and `sans`), for a server or a client.
    fn sign(&self, dir: &Path, cn: &str, sans: &[&str], server: bool) -> (PathBuf, PathBuf) {
        let mut params =
            CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).expect("leaf parameters");
        params.distinguished_name.push(DnType::CommonName, cn);
        params.extended_key_usages =
            vec![if server { ExtendedKeyUsagePurpose::ServerAuth } else { ExtendedKeyUsagePurpose::ClientAuth }];
        let key = KeyPair::generate().expect("a leaf key");
        let cert = params.signed_by(&key, &self.issuer).expect("a signed leaf");
        let (c, k) = (dir.join(format!("{cn}.crt")), dir.join(format!("{cn}.key")));
        std::fs::write(&c, cert.pem()).expect("writing a certificate");
        std::fs::write(&k, key.serialize_pem()).expect("writing a key");
        (c, k)
    }
}

fn refusal<T: std::fmt::Debug>(r: Result<T, ClientError>) -> (u16, String) {
    match r {
        Err(ClientError::Api(e)) => (e.status, e.code),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn a_tcp_caller_is_who_its_certificate_says_and_nobody_without_one() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("a temporary directory");
    let d = dir.path();
    let ca = Ca::new(d, "pdstor-test-ca");
    let other = Ca::new(d, "some-other-ca");
    let (server_cert, server_key) = ca.sign(d, "pdstor-daemon", &["localhost", "127.0.0.1"], true);
    let prefill = ca.sign(d, "prefill.team-a", &["prefill.team-a"], false);
    let stranger = ca.sign(d, "stranger", &[], false);
    let intruder = other.sign(d, "prefill.team-a.forged", &["prefill.team-a"], false);
    let config = d.join("pdstor.toml");
    std::fs::write(
        &config,
        "[[principal]]\ntenant = \"team-a\"\nroles = [\"writer\", \"reader\"]\ncert_names = [\"prefill.team-a\"]\n",
    )
    .expect("the config");
    let target = pdstor_tests::format_file(d, 4, SLOT);
    let path = |p: &Path| p.to_str().expect("a UTF-8 path").to_owned();
    let (sc, sk, cc, cfg) = (path(&server_cert), path(&server_key), path(&ca.pem), path(&config));
    let daemon = Daemon::start_with(
        &target,
        d,
        &["--config", &cfg, "--tls-cert", &sc, "--tls-key", &sk, "--tls-client-ca", &cc],
    );
    let log = std::fs::read_to_string(&daemon.log).unwrap_or_default();
    assert!(!log.contains("--insecure-tcp"), "mutual TLS needs no insecure flag: {log}");

    // The named client: its tenant's writer.
    let team_a = Client::with_tls(&daemon.server, &ca.pem, Some((&prefill.0, &prefill.1)));
    let p = team_a.prepare("over-tls", &layout(), 1, "prefill").expect("a prepare over mutual TLS");
    let listed = team_a.publications(None, false).expect("its listing");
    assert_eq!(listed.len(), 1);

    // No certificate: the handshake completes, and every step is 401.
    let anonymous = Client::with_tls(&daemon.server, &ca.pem, None);
    assert_eq!(refusal(anonymous.prepare("anon", &layout(), 1, "x")), (401, "unauthenticated".into()));
    assert_eq!(refusal(anonymous.cancel("over-tls")), (401, "unauthenticated".into()));
    // A certificate the CA signed, naming no principal: 403.
    let nobody = Client::with_tls(&daemon.server, &ca.pem, Some((&stranger.0, &stranger.1)));
    assert_eq!(refusal(nobody.prepare("stranger", &layout(), 1, "x")), (403, "forbidden".into()));
    assert_eq!(refusal(nobody.abort(p.publication, &p.writer_token)), (403, "forbidden".into()));
    // A certificate another CA signed, even with the right name: no handshake.
    let forged = Client::with_tls(&daemon.server, &ca.pem, Some((&intruder.0, &intruder.1)));
    match forged.prepare("forged", &layout(), 1, "x") {
        Err(ClientError::Transport { .. }) => {}
        other => panic!("a certificate of another CA was let in: {other:?}"),
    }
    // And the client checks the daemon: a daemon its CA did not sign is refused.
    let gullible = Client::with_tls(&daemon.server, &other.pem, Some((&prefill.0, &prefill.1)));
    match gullible.healthz() {
        Err(ClientError::Transport { message, .. }) => {
            assert!(message.to_lowercase().contains("certificate"), "{message}")
        }
        other => panic!("the client trusted a daemon its CA did not sign: {other:?}"),
    }
    let listed = team_a.publications(None, false).expect("its listing");
    assert_eq!(listed.iter().map(|l| l.req_id.as_str()).collect::<Vec<_>>(), ["over-tls"], "nothing else was prepared");

    // The CLI takes its files from the environment; its exit status says who was refused.
    let cancel = |cert: Option<&(PathBuf, PathBuf)>| {
        let mut c = Command::new(pdstor_bin());
        c.args(["cancel", "--req", "over-tls", "--server", &daemon.server]).env("PDSTOR_TLS_CA", &ca.pem);
        if let Some((crt, key)) = cert {
            c.env("PDSTOR_TLS_CERT", crt).env("PDSTOR_TLS_KEY", key);
        }
        c.output().expect("pdstor cancel")
    };
    let out = cancel(None);
    assert_eq!(
        out.status.code(),
        Some(pdstor::api::error::EXIT_DENIED as i32),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = cancel(Some(&prefill));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(team_a.publications(None, false).expect("its listing").is_empty(), "its own cancel went through");
}
