//! The control plane across hosts (issue 16): mutual TLS, with certificates
//! generated here at test time. A client is who its certificate names; one
//! with no certificate is `unauthenticated`, one with a name the config does
//! not know is `forbidden`, one signed by another CA, expired or revoked
//! never completes the handshake and is told why; a client refuses a daemon
//! its CA did not sign. Revocation lists and the config are read again on
//! SIGHUP and on a file's change (issue 54), under load, losing no step.

use std::path::{Path, PathBuf};
use std::process::Command;

use pdstor_client::layout::Layout;
use pdstor_client::{Client, ClientError};
use pdstor_tests::{Daemon, pdstor_bin};
use rcgen::{
    BasicConstraints, CertificateParams, CertificateRevocationListParams, CertifiedIssuer, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyIdMethod, KeyPair, RevokedCertParams, SerialNumber, date_time_ymd,
};

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
        self.leaf(dir, cn, sans, server, |_| {})
    }

    /// A client certificate for `cn` with serial number `serial`, which
    /// `expired` makes a certificate whose validity ended in 2021.
    fn client(&self, dir: &Path, cn: &str, serial: u64, expired: bool) -> (PathBuf, PathBuf) {
        self.leaf(dir, cn, &[], false, |p| {
            p.serial_number = Some(SerialNumber::from(serial));
            if expired {
                (p.not_before, p.not_after) = (date_time_ymd(2020, 1, 1), date_time_ymd(2021, 1, 1));
            }
        })
    }

    /// Writes (write, then rename: as an operator's tooling replaces it) a
    /// CRL from this CA revoking `serials` to `path`.
    fn revoke(&self, path: &Path, serials: &[u64]) {
        // A minute back: the daemon's clock and this one are the same clock,
        // but a CRL from the future is nothing to test here.
        let now = time::OffsetDateTime::now_utc() - std::time::Duration::from_secs(60);
        let crl = CertificateRevocationListParams {
            this_update: now,
            next_update: now + std::time::Duration::from_secs(86_400),
            crl_number: SerialNumber::from(time::OffsetDateTime::now_utc().unix_timestamp_nanos() as u64),
            issuing_distribution_point: None,
            revoked_certs: serials
                .iter()
                .map(|&s| RevokedCertParams {
                    serial_number: SerialNumber::from(s),
                    revocation_time: now,
                    reason_code: Some(rcgen::RevocationReason::KeyCompromise),
                    invalidity_date: None,
                })
                .collect(),
            key_identifier_method: KeyIdMethod::Sha256,
        }
        .signed_by(&self.issuer)
        .expect("a signed CRL");
        replace(path, crl.pem().expect("the CRL as PEM").as_bytes());
    }

    fn leaf(
        &self,
        dir: &Path,
        cn: &str,
        sans: &[&str],
        server: bool,
        edit: impl FnOnce(&mut CertificateParams),
    ) -> (PathBuf, PathBuf) {
        let mut params =
            CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).expect("leaf parameters");
        edit(&mut params);
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
    // A certificate another CA signed, even with the right name: no handshake, and the client is told.
    let forged = Client::with_tls(&daemon.server, &ca.pem, Some((&intruder.0, &intruder.1)));
    let told = certificate_refused(forged.prepare("forged", &layout(), 1, "x"));
    assert!(told.contains("client CA did not sign it"), "{told}");
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
        Some(pdstor_client::code::EXIT_DENIED as i32),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = cancel(Some(&prefill));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(team_a.publications(None, false).expect("its listing").is_empty(), "its own cancel went through");
}

/// The message of a refusal of this client's certificate in the handshake.
fn certificate_refused<T: std::fmt::Debug>(r: Result<T, ClientError>) -> String {
    match r {
        Err(ClientError::Api(e))
            if (e.status, e.code.as_str(), e.field.as_str()) == (401, "unauthenticated", "certificate") =>
        {
            assert!(e.message.contains("refused this client's certificate in the TLS handshake"), "{}", e.message);
            e.message
        }
        other => panic!("expected the certificate to be refused in the handshake, got {other:?}"),
    }
}

/// Replaces `path` as deployment tooling does: a new file renamed over it.
fn replace(path: &Path, bytes: &[u8]) {
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, bytes).expect("writing the new file");
    std::fs::rename(&tmp, path).expect("renaming it into place");
}

/// The daemon's reloads that ended `result` (applied or failed), by `c`.
fn reloads(c: &Client, result: &str) -> u64 {
    let series = format!("pdstor_reloads_total{{result=\"{result}\"}} ");
    let m = c.metrics().expect("the metrics");
    m.lines().find_map(|l| l.strip_prefix(series.as_str())).map_or(0, |v| v.trim().parse().expect("a count"))
}

/// Waits (20 s at most) until `c` sees `n` reloads ended `result`.
fn await_reloads(d: &Daemon, c: &Client, result: &str, n: u64) {
    d.eventually(&format!("{n} {result} reloads"), || (reloads(c, result) >= n).then_some(()));
}

/// A daemon in `d` serving mutual TLS with a certificate `ca` signed, and
/// its clients' CA, with `config` and the CRL `crl` when given.
fn tls_daemon(d: &Path, ca: &Ca, config: Option<&Path>, crl: Option<&Path>) -> Daemon {
    let (cert, key) = ca.sign(d, "pdstor-daemon", &["localhost", "127.0.0.1"], true);
    let path = |p: &Path| p.to_str().expect("a UTF-8 path").to_owned();
    let mut args = vec!["--tls-cert".to_owned(), path(&cert), "--tls-key".into(), path(&key)];
    args.extend(["--tls-client-ca".to_owned(), path(&ca.pem)]);
    args.extend(config.into_iter().flat_map(|c| ["--config".to_owned(), path(c)]));
    args.extend(crl.into_iter().flat_map(|c| ["--tls-crl".to_owned(), path(c)]));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Daemon::start_with(&pdstor_tests::format_file(d, 8, SLOT), d, &args)
}

#[test]
fn a_revoked_certificate_is_shut_out_on_its_next_connection_while_others_carry_on() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("a temporary directory");
    let d = dir.path();
    let ca = Ca::new(d, "fleet-ca");
    let prefill = ca.client(d, "prefill-1.team-a", 1001, false);
    let stolen = ca.client(d, "prefill-2.team-a", 1002, false);
    let crl = d.join("fleet.crl");
    ca.revoke(&crl, &[]);
    let config = d.join("pdstor.toml");
    let names = "cert_names = [\"prefill-1.team-a\", \"prefill-2.team-a\", \"prefill-3.team-a\"]";
    let ops = "[[principal]]\ntenant = \"team-a\"\nroles = [\"admin\"]\ncert_names = [\"ops.team-a\"]\n";
    let principal = format!("[[principal]]\ntenant = \"team-a\"\nroles = [\"writer\", \"reader\"]\n{names}\n");
    std::fs::write(&config, format!("{principal}{ops}")).expect("the config");
    let daemon = tls_daemon(d, &ca, Some(&config), Some(&crl));
    let cr = crl.to_str().expect("a UTF-8 path").to_owned();
    let good = Client::with_tls(&daemon.server, &ca.pem, Some((&prefill.0, &prefill.1)));
    let admin = ca.client(d, "ops.team-a", 900, false);
    let ops = Client::with_tls(&daemon.server, &ca.pem, Some((&admin.0, &admin.1)));
    let thief = Client::with_tls(&daemon.server, &ca.pem, Some((&stolen.0, &stolen.1)));
    thief.prepare("before", &layout(), 1, "prefill-2").expect("not revoked yet");

    // The good client keeps stepping all through: every step of it answers.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let busy = {
        let (stop, server, ca_pem, cert) = (stop.clone(), daemon.server.clone(), ca.pem.clone(), prefill.clone());
        std::thread::spawn(move || {
            let c = Client::with_tls(&server, &ca_pem, Some((&cert.0, &cert.1)));
            let mut steps = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let req = format!("busy-{steps}");
                c.prepare(&req, &layout(), 1, "prefill-1").unwrap_or_else(|e| panic!("prepare {req}: {e}"));
                c.cancel(&req).unwrap_or_else(|e| panic!("cancel {req}: {e}"));
                steps += 2;
            }
            steps
        })
    };

    // The CA revokes the stolen certificate; the new CRL replaces the file: read on its change alone.
    ca.revoke(&crl, &[1002]);
    daemon.eventually("the reload to take effect", || thief.publications(None, false).err());
    let told = certificate_refused(thief.prepare("after", &layout(), 1, "prefill-2"));
    assert!(told.contains("revoked"), "{told}");
    assert!(reloads(&ops, "applied") >= 1);

    // A CRL that does not parse is refused whole: what was in force stays, and the log says why.
    replace(&crl, b"-----BEGIN X509 CRL-----\nbm90IGEgQ1JM\n-----END X509 CRL-----\n");
    daemon.hangup();
    await_reloads(&daemon, &ops, "failed", 1);
    let told = certificate_refused(thief.prepare("broken", &layout(), 1, "x"));
    assert!(told.contains("revoked"), "{told}");
    let log = std::fs::read_to_string(&daemon.log).unwrap_or_default();
    assert!(log.contains("failed, nothing changed") && log.contains(&cr), "{log}");

    // The fleet adds a client CA: its clients are refused until the bundle and its CRL are in place.
    let ca2 = Ca::new(d, "fleet-ca-2");
    let newcomer = ca2.client(d, "prefill-3.team-a", 3003, false);
    let fresh = Client::with_tls(&daemon.server, &ca.pem, Some((&newcomer.0, &newcomer.1)));
    let told = certificate_refused(fresh.prepare("new", &layout(), 1, "prefill-3"));
    assert!(told.contains("client CA did not sign it"), "{told}");
    let pem = |p: &Path| std::fs::read_to_string(p).expect("a PEM file");
    let crl2 = d.join("fleet-2.crl");
    ca.revoke(&crl, &[1002]);
    ca2.revoke(&crl2, &[]);
    let bundle = d.join("clients-ca.pem");
    replace(&bundle, format!("{}{}", pem(&ca.pem), pem(&ca2.pem)).as_bytes());
    replace(&crl, format!("{}{}", pem(&crl), pem(&crl2)).as_bytes());
    // The daemon was started with --tls-client-ca fleet-ca.pem: the bundle takes its place.
    replace(&ca.pem, pem(&bundle).as_bytes());
    daemon.hangup();
    daemon.eventually("the reload to take effect", || fresh.prepare("new", &layout(), 1, "prefill-3").ok());
    certificate_refused(thief.prepare("still", &layout(), 1, "x"));

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let steps = busy.join().expect("every step of the good client answered through every reload");
    assert!(steps > 0, "the good client stepped while the daemon reloaded");
    let listed = good.publications(None, false).expect("the good client's listing");
    let mut held: Vec<&str> = listed.iter().map(|p| p.req_id.as_str()).collect();
    held.sort();
    assert_eq!(held, ["before", "new"], "nothing else is held");
}

#[test]
fn an_expired_certificate_is_told_so_in_words() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("a temporary directory");
    let d = dir.path();
    let ca = Ca::new(d, "pdstor-test-ca");
    let expired = ca.client(d, "prefill.team-a", 7, true);
    let daemon = tls_daemon(d, &ca, None, None);
    let c = Client::with_tls(&daemon.server, &ca.pem, Some((&expired.0, &expired.1)));
    let told = certificate_refused(c.prepare("late", &layout(), 1, "x"));
    assert!(told.contains("expired") && !told.contains("is `pdstor serve` running"), "{told}");
    let out = Command::new(pdstor_bin())
        .args(["cancel", "--req", "late", "--server", &daemon.server])
        .env("PDSTOR_TLS_CA", &ca.pem)
        .env("PDSTOR_TLS_CERT", &expired.0)
        .env("PDSTOR_TLS_KEY", &expired.1)
        .output()
        .expect("pdstor cancel");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(pdstor_client::code::EXIT_DENIED as i32), "{stderr}");
    assert!(stderr.contains("refused this client's certificate") && stderr.contains("expired"), "{stderr}");
}

/// One `GET path` on a kept-alive connection: the status, the
/// `connection` header and the body.
fn get_kept_alive(s: &mut (impl std::io::Read + std::io::Write), path: &str) -> (u16, String, String) {
    write!(s, "GET {path} HTTP/1.1\r\nhost: pdstor\r\naccept: application/json\r\n\r\n").expect("the request");
    s.flush().expect("sent");
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut byte).expect("the answer's header");
        head.push(byte[0]);
    }
    let head = String::from_utf8(head).expect("a text header").to_ascii_lowercase();
    let status = head.split(' ').nth(1).and_then(|v| v.parse().ok()).expect("a status");
    let header = |name: &str| {
        head.lines().find_map(|l| l.strip_prefix(name).map(|v| v.trim_start_matches(':').trim().to_owned()))
    };
    let len: usize = header("content-length").and_then(|v| v.parse().ok()).expect("a content length");
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).expect("the answer's body");
    (status, header("connection").unwrap_or_default(), String::from_utf8_lossy(&body).into_owned())
}

#[test]
fn a_kept_alive_connection_is_judged_again_after_a_reload() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("a temporary directory");
    let d = dir.path();
    let ca = Ca::new(d, "keep-ca");
    let keeper = ca.client(d, "keeper.team-a", 77, false);
    let crl = d.join("keep.crl");
    ca.revoke(&crl, &[]);
    let config = d.join("pdstor.toml");
    let rule =
        "[[principal]]\ntenant = \"team-a\"\nroles = [\"reader\", \"admin\"]\ncert_names = [\"keeper.team-a\"]\n";
    std::fs::write(&config, rule).expect("the config");
    let daemon = tls_daemon(d, &ca, Some(&config), Some(&crl));

    let tls = pdstor_client::tls::client_config(&ca.pem, Some((&keeper.0, &keeper.1))).expect("the client's TLS");
    let over = |tcp: std::net::TcpStream| {
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1").expect("a server name");
        rustls::StreamOwned::new(rustls::ClientConnection::new(tls.clone(), name).expect("a TLS client"), tcp)
    };
    let mut kept = over(std::net::TcpStream::connect(&daemon.addr).expect("connecting"));
    let (status, _, body) = get_kept_alive(&mut kept, "/storage-pd/publications");
    assert_eq!(status, 200, "{body}");
    // A connection whose handshake has not begun when the reload lands.
    let stalled = std::net::TcpStream::connect(&daemon.addr).expect("connecting");
    daemon.eventually("the stalled connection accepted", || {
        let (_, _, metrics) = get_kept_alive(&mut kept, "/metrics");
        let accepted = metrics.lines().find_map(|l| l.strip_prefix("pdstor_control_connections_total "));
        (accepted.and_then(|n| n.trim().parse::<u64>().ok()) >= Some(2)).then_some(())
    });

    // The CA revokes the certificate while the connection stays open.
    ca.revoke(&crl, &[77]);
    daemon.hangup();
    let fresh = Client::with_tls(&daemon.server, &ca.pem, Some((&keeper.0, &keeper.1)));
    daemon.eventually("the reload to take effect", || fresh.publications(None, false).err());
    let (status, connection, body) = get_kept_alive(&mut kept, "/storage-pd/publications");
    assert_eq!((status, connection.as_str()), (401, "close"), "{body}");
    assert!(body.contains("\"field\":\"certificate\"") && body.contains("no longer accepted"), "{body}");
    assert!(body.contains("revoked") || body.contains("Revoked"), "{body}");
    let mut rest = Vec::new();
    let _ = std::io::Read::read_to_end(&mut kept, &mut rest);
    assert!(rest.is_empty(), "the daemon closed the connection after its answer");
    // The stalled one shook hands with the files it took before the reload: its first request is judged again.
    let (status, _, body) = get_kept_alive(&mut over(stalled), "/storage-pd/publications");
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("no longer accepted"), "{body}");
}
