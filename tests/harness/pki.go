package main

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// Files under DIR/pki. One CA signs everything: the serving certificate
// (shared by every apiserver, controller manager and scheduler, all on
// 127.0.0.1), the admin client certificate, and, through the controller
// manager, CSRs. Tests may use ca.key to sign webhook serving certificates.
const (
	caCertFile      = "ca.crt"
	caKeyFile       = "ca.key"
	servingCertFile = "apiserver.crt"
	servingKeyFile  = "apiserver.key"
	adminCertFile   = "admin.crt"
	adminKeyFile    = "admin.key"
	saKeyFile       = "sa.key"
	saPubFile       = "sa.pub"
)

// ensurePKI generates the PKI into dir unless it is already there. It is
// generated into a temporary directory and renamed, so dir is either
// complete or absent.
func ensurePKI(dir string) error {
	if _, err := os.Stat(dir); err == nil {
		return nil
	}
	tmp, err := os.MkdirTemp(filepath.Dir(dir), ".pki-")
	if err != nil {
		return err
	}
	if err := generatePKI(tmp); err != nil {
		os.RemoveAll(tmp)
		return err
	}
	return os.Rename(tmp, dir)
}

func generatePKI(dir string) error {
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	caTmpl := certTemplate(pkix.Name{CommonName: "volume-gate-harness-ca"})
	caTmpl.IsCA = true
	caTmpl.BasicConstraintsValid = true
	caTmpl.KeyUsage = x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, caKey.Public(), caKey)
	if err != nil {
		return err
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return err
	}
	if err := writeCertAndKey(dir, caCertFile, caKeyFile, caDER, caKey); err != nil {
		return err
	}

	serving := certTemplate(pkix.Name{CommonName: "kube-apiserver"})
	serving.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
	serving.DNSNames = []string{"localhost", "kubernetes", "kubernetes.default",
		"kubernetes.default.svc", "kubernetes.default.svc.cluster.local"}
	// 10.96.0.1 is the kubernetes Service's ClusterIP in --service-cluster-ip-range;
	// 10.244.0.1 the real node's IP (node.go), by which its Pods reach the
	// tenant API servers.
	serving.IPAddresses = []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback, net.IPv4(10, 96, 0, 1), net.IPv4(10, 244, 0, 1)}
	if err := issue(dir, servingCertFile, servingKeyFile, serving, ca, caKey); err != nil {
		return err
	}

	admin := certTemplate(pkix.Name{CommonName: "admin", Organization: []string{"system:masters"}})
	admin.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
	if err := issue(dir, adminCertFile, adminKeyFile, admin, ca, caKey); err != nil {
		return err
	}

	saKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return err
	}
	pub, err := x509.MarshalPKIXPublicKey(&saKey.PublicKey)
	if err != nil {
		return err
	}
	if err := writePEM(filepath.Join(dir, saPubFile), "PUBLIC KEY", pub, 0o644); err != nil {
		return err
	}
	return writeKey(filepath.Join(dir, saKeyFile), saKey)
}

func certTemplate(subject pkix.Name) *x509.Certificate {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		panic(err) // crypto/rand does not fail on Linux
	}
	now := time.Now()
	return &x509.Certificate{
		SerialNumber: serial,
		Subject:      subject,
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.AddDate(10, 0, 0),
		KeyUsage:     x509.KeyUsageDigitalSignature,
	}
}

func issue(dir, certFile, keyFile string, tmpl, ca *x509.Certificate, caKey crypto.Signer) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, key.Public(), caKey)
	if err != nil {
		return fmt.Errorf("sign %s: %w", certFile, err)
	}
	return writeCertAndKey(dir, certFile, keyFile, der, key)
}

func writeCertAndKey(dir, certFile, keyFile string, der []byte, key crypto.Signer) error {
	if err := writePEM(filepath.Join(dir, certFile), "CERTIFICATE", der, 0o644); err != nil {
		return err
	}
	return writeKey(filepath.Join(dir, keyFile), key)
}

func writeKey(path string, key crypto.Signer) error {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return err
	}
	return writePEM(path, "PRIVATE KEY", der, 0o600)
}

func writePEM(path, blockType string, der []byte, perm os.FileMode) error {
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: blockType, Bytes: der}), perm)
}
