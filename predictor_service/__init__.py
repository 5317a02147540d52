"""predictor_service"""
